//! What a role may do on an outbox table, checked before it is needed: a relay whose role lacks a
//! privilege fails readiness with the GRANT to run, rather than publishing events it cannot then
//! mark, again and again.

use sqlx::PgConnection;

use txoutbox_core::{Error, ErrorKind};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

/// Checks that the session's role holds each of `privileges` (`SELECT`, `INSERT`, `UPDATE`,
/// `DELETE`) on `table`, and, with `sequence`, `USAGE` on the table's `seq` sequence (which its
/// writer-order trigger draws from). `why` says what needs them.
///
/// # Errors
/// [`ErrorKind::PermissionDenied`] naming the role, what it lacks, and the GRANT statements that
/// give it; a database error.
pub(crate) async fn check_privileges(
    conn: &mut PgConnection,
    table: &OutboxTable,
    privileges: &[&str],
    sequence: bool,
    why: &str,
) -> Result<(), Error> {
    let (held, sequence_usage, role, seq): (Vec<bool>, bool, String, Option<String>) =
        sqlx::query_as(
            "SELECT array_agg(has_table_privilege($1::regclass, p) ORDER BY o),
                    NOT $3 OR coalesce(has_sequence_privilege(pg_get_serial_sequence($1, 'seq'), 'USAGE'), true),
                    current_user::text,
                    pg_get_serial_sequence($1, 'seq')
             FROM unnest($2::text[]) WITH ORDINALITY AS u(p, o)",
        )
        .bind(table.qualified())
        .bind(privileges)
        .bind(sequence)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| map_sqlx("check privileges", e))?;
    let missing: Vec<&str> = privileges
        .iter()
        .zip(&held)
        .filter(|(_, ok)| !**ok)
        .map(|(p, _)| *p)
        .collect();
    if missing.is_empty() && sequence_usage {
        return Ok(());
    }
    let mut lacks = missing.join(", ");
    let mut grants = Vec::new();
    if !missing.is_empty() {
        lacks = format!("{lacks} on {}", table.qualified());
        grants.push(format!(
            "GRANT {} ON {} TO {role}",
            privileges.join(", "),
            table.qualified()
        ));
    }
    if !sequence_usage {
        let seq = seq.unwrap_or_else(|| format!("{}_seq_seq", table.qualified()));
        if !lacks.is_empty() {
            lacks.push_str(" and ");
        }
        lacks.push_str(&format!("USAGE on the sequence {seq}"));
        grants.push(format!("GRANT USAGE ON SEQUENCE {seq} TO {role}"));
    }
    Err(Error::new(
        ErrorKind::PermissionDenied,
        format!(
            "the role {role} lacks {lacks}, which {why}: {}",
            grants.join("; ")
        ),
    )
    .with_context(GRANT_CONTEXT, grants.join("; ")))
}

/// The context key of a missing privilege's error: the GRANT statements that give it.
const GRANT_CONTEXT: &str = "grant";

/// The role's `REPLICATION` attribute, which a logical slot's reader needs (a superuser has it;
/// on Amazon RDS and Aurora, membership in `rds_replication` gives it): an error naming the
/// `ALTER ROLE` (or the `GRANT rds_replication`) that gives it when the role lacks it.
///
/// # Errors
/// The missing attribute (a missing grant, [`is_missing_grant`]); a database error.
pub(crate) async fn check_replication(conn: &mut PgConnection, why: &str) -> Result<(), Error> {
    let (role, may, rds): (String, bool, bool) = sqlx::query_as(
        "SELECT quote_ident(session_user),
                coalesce((SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = session_user), false)
                OR CASE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication')
                        THEN pg_has_role(session_user, 'rds_replication', 'MEMBER') ELSE false END,
                EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication')",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("privilege check", e))?;
    if may {
        return Ok(());
    }
    let fix = if rds {
        format!("GRANT rds_replication TO {role}")
    } else {
        format!("ALTER ROLE {role} REPLICATION")
    };
    Err(Error::new(
        ErrorKind::PermissionDenied,
        format!("the role {role} lacks the REPLICATION attribute, which {why}: {fix}"),
    )
    .with_context(GRANT_CONTEXT, fix))
}

/// Whether `e` is a privilege the role lacks, as the stores' checks report it (not a failed login,
/// which is a permission error too): waiting for the grant, rather than failing, is the cure.
pub fn is_missing_grant(e: &Error) -> bool {
    e.kind() == ErrorKind::PermissionDenied && e.context_value(GRANT_CONTEXT).is_some()
}
