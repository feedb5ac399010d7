//! Least privilege: the README's "Roles and privileges" statements, run exactly as written there
//! (names made unique), then `outbox migrate` and `outbox wal setup` as the owner, the writer API,
//! plain SQL and table-less events as the writer, and `outbox relay` (killed once under load and
//! started again), `status` and `dead-letters list` as the relay, for each source; judged against
//! what the writer committed. And a relay role missing a grant: it claims nothing, readiness fails,
//! the log names the GRANT, and once granted every event is published once.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::testkit::sample_event;
use txoutbox_postgres::testing::{database_url, pool, unmigrated_table};
use txoutbox_postgres::wal::{MessageWriter, WalConfig};
use txoutbox_postgres::{connect, OutboxTable, Writer};
use txoutbox_tests::harness::{
    assert_crash_verdict, free_port, http_status, logged, outbox_cli, relay_log_dir, report_with,
    wait_until, Broker, RelayProcess, Sink,
};
use uuid::Uuid;

/// The SQL blocks of the README's "Roles and privileges" section, in order: the owner, the writer,
/// the relay under the polling source, the relay under the WAL source.
fn readme_blocks() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let start = readme
        .find("## Roles and privileges")
        .expect("the README has a \"Roles and privileges\" section");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let blocks: Vec<String> = section
        .split("```sql\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap().to_string())
        .collect();
    assert_eq!(blocks.len(), 4, "owner, writer, polling relay, WAL relay");
    blocks
}

/// Held while roles are made, granted or dropped (see `Roles::run`).
static CATALOG: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The roles of one test and its table.
struct Roles {
    owner: String,
    writer: String,
    relay: String,
    table: OutboxTable,
}

impl Roles {
    fn new() -> Roles {
        let tag = &Uuid::new_v4().simple().to_string()[..8];
        Roles {
            owner: format!("outbox_lp_{tag}_owner"),
            writer: format!("outbox_lp_{tag}_writer"),
            relay: format!("outbox_lp_{tag}_relay"),
            table: unmigrated_table(),
        }
    }

    /// A README block with this test's names.
    fn render(&self, sql: &str) -> String {
        let schema = format!("\"{}\"", self.table.schema());
        sql.replace("outbox_owner", &self.owner)
            .replace("outbox_writer", &self.writer)
            .replace("outbox_relay", &self.relay)
            .replace("DATABASE app", "DATABASE test")
            .replace("SCHEMA public", &format!("SCHEMA {schema}"))
            .replace("public.", &format!("{schema}."))
    }

    async fn run(&self, pg: &sqlx::PgPool, sql: &str) {
        use sqlx::Executor;
        // Grants on the database update one catalog row: two at once fail ("tuple concurrently
        // updated"), so the tests of this binary run them one at a time.
        let _one = CATALOG.lock().await;
        pg.execute(sqlx::raw_sql(&self.render(sql)))
            .await
            .unwrap_or_else(|e| panic!("the README's statements fail: {e}\n{}", self.render(sql)));
    }

    /// The test database's URL for `role`, its sessions named `name`.
    fn url(role: &str, name: &str) -> String {
        let url = database_url().replacen("postgres@", &format!("{role}@"), 1);
        assert!(
            url.contains(role),
            "DATABASE_URL names the user postgres: {url}"
        );
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}application_name={name}")
    }

    /// Runs the `outbox` CLI as `role` with `env`; its exit code and output.
    fn cli(&self, role: &str, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
        let url = Roles::url(role, "outbox-test-cli");
        let mut all = vec![
            ("DATABASE_URL", url.as_str()),
            ("OUTBOX_DATABASE__SCHEMA", self.table.schema()),
            ("OUTBOX_WAL__MESSAGE_PREFIX", self.table.schema()),
        ];
        all.extend_from_slice(env);
        outbox_cli(args, &all)
    }

    /// The table's schema (as the superuser), the owner (the README's first block), and
    /// `outbox migrate` as the owner.
    async fn owner_migrates(&self, pg: &sqlx::PgPool, owner_sql: &str) {
        sqlx::query(&format!("CREATE SCHEMA \"{}\"", self.table.schema()))
            .execute(pg)
            .await
            .unwrap();
        self.run(pg, owner_sql).await;
        let (code, out) = self.cli(&self.owner, &["migrate"], &[]);
        assert_eq!(code, Some(0), "migrate as the owner: {out}");
    }

    /// Drops the schema, the slot, the publication and the roles (as the superuser).
    async fn drop_all(&self, pg: &sqlx::PgPool) {
        let _one = CATALOG.lock().await;
        let config = WalConfig {
            message_prefix: self.table.schema().to_string(),
            ..WalConfig::default()
        };
        let slot = config.slot(&self.table).unwrap();
        for _ in 0..100 {
            if slot.drop(pg).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.table.schema()
        ))
        .execute(pg)
        .await;
        for role in [&self.relay, &self.writer, &self.owner] {
            let _ = sqlx::query(&format!("DROP OWNED BY {role} CASCADE"))
                .execute(pg)
                .await;
            let _ = sqlx::query(&format!("DROP ROLE IF EXISTS {role}"))
                .execute(pg)
                .await;
        }
    }
}

/// Writes as the writer role until `stop`: a transaction a round, one event per aggregate through
/// the writer API, one by plain SQL, and (`messages`) one table-less event. Returns what committed,
/// in commit order.
async fn write_as(
    roles: &Roles,
    messages: bool,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(String, Uuid)>> {
    let writer_pool = connect(&Roles::url(&roles.writer, "outbox-test-writer"), 2)
        .await
        .unwrap();
    let table = roles.table.clone();
    tokio::spawn(async move {
        let writer = Writer::new(table.clone());
        let message_writer = MessageWriter::new(table.schema(), &table);
        let mut committed = Vec::new();
        let mut round = 0;
        while !stop.load(Ordering::SeqCst) || round < 20 {
            let mut tx = writer_pool.begin().await.unwrap();
            let mut ids = Vec::new();
            for a in 0..4 {
                let e = sample_event(&format!("agg-{a}"), round);
                ids.push((
                    e.aggregate_id.clone(),
                    writer.enqueue(&mut tx, e).await.unwrap(),
                ));
            }
            let id = Uuid::new_v4();
            sqlx::query(&format!(
                "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ($1, 'order', 'plain', 'order.created', '{{\"n\": 1}}')",
                table.qualified()
            ))
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
            ids.push(("plain".to_string(), id));
            if messages {
                let e = sample_event("message", round);
                ids.push((
                    e.aggregate_id.clone(),
                    message_writer.emit(&mut tx, e).await.unwrap(),
                ));
            }
            tx.commit().await.unwrap();
            committed.extend(ids);
            round += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        committed
    })
}

async fn under_least_privilege(wal: bool, scenario: &str) {
    let pg = pool(2).await;
    let roles = Roles::new();
    let blocks = readme_blocks();
    roles.owner_migrates(&pg, &blocks[0]).await;
    let source: &[(&str, &str)] = if wal {
        &[("OUTBOX_DATABASE__SOURCE", "wal")]
    } else {
        &[]
    };
    if wal {
        let (code, out) = roles.cli(&roles.owner, &["wal", "setup"], &[]);
        assert_eq!(code, Some(0), "wal setup as the owner: {out}");
    }
    roles.run(&pg, &blocks[1]).await;
    roles.run(&pg, &blocks[if wal { 3 } else { 2 }]).await;

    let sink = Sink::new(Broker::Amqp).await;
    let relay_env = |name: &str| {
        let mut env = vec![("DATABASE_URL".to_string(), Roles::url(&roles.relay, name))];
        if wal {
            env.push(("OUTBOX_DATABASE__SOURCE".into(), "wal".into()));
            env.push((
                "OUTBOX_WAL__MESSAGE_PREFIX".into(),
                roles.table.schema().to_string(),
            ));
        }
        env
    };
    let start = |name: &str| {
        let env = relay_env(name);
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        RelayProcess::start(&roles.table, &sink, &pairs)
    };
    let stop = Arc::new(AtomicBool::new(false));
    let writing = write_as(&roles, wal, stop.clone()).await;
    let relay = start("outbox-test-relay-a");
    sink.wait_past(0, Duration::from_secs(60), "the relay published nothing")
        .await;
    // A crash under load, as that role.
    relay.kill9();
    let before = sink.received_count().await;
    let relay = start("outbox-test-relay-b");
    sink.wait_past(
        before,
        Duration::from_secs(60),
        "the relay published nothing after its restart",
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let committed = writing.await.unwrap();
    sink.wait_all(&committed, Duration::from_secs(120)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    for args in [
        &["status"][..],
        &["dead-letters", "list"][..],
        &["cleanup", "--older-than", "1h"][..],
        &["check"][..],
    ] {
        let (code, out) = roles.cli(&roles.relay, args, source);
        assert_eq!(code, Some(0), "outbox {args:?} as the relay: {out}");
    }
    let verdict = sink.judge(&committed).await;
    report_with(
        scenario,
        Broker::Amqp,
        &verdict,
        &format!(" source={}", if wal { "wal" } else { "polling" }),
    );
    assert_crash_verdict(&verdict, 1, 100, 3);
    let _ = std::fs::remove_dir_all(relay_log_dir(&roles.table));
    roles.drop_all(&pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_source_under_the_readme_roles() {
    under_least_privilege(false, "least-privilege-polling-kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_source_under_the_readme_roles() {
    under_least_privilege(true, "least-privilege-wal-kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_role_missing_a_grant_claims_nothing_until_granted() {
    let pg = pool(2).await;
    let roles = Roles::new();
    let blocks = readme_blocks();
    roles.owner_migrates(&pg, &blocks[0]).await;
    roles.run(&pg, &blocks[1]).await;
    // The polling relay's grants without UPDATE: it could claim and publish, never mark.
    roles
        .run(
            &pg,
            &blocks[2].replace("SELECT, UPDATE, DELETE", "SELECT, DELETE"),
        )
        .await;
    let stop = Arc::new(AtomicBool::new(true));
    let committed = write_as(&roles, false, stop).await.await.unwrap();
    let sink = Sink::new(Broker::Amqp).await;
    let http = format!("127.0.0.1:{}", free_port());
    let url = Roles::url(&roles.relay, "outbox-test-relay");
    let relay = RelayProcess::start(
        &roles.table,
        &sink,
        &[
            ("DATABASE_URL", url.as_str()),
            ("OUTBOX_HTTP__ENABLED", "true"),
            ("OUTBOX_HTTP__LISTEN", http.as_str()),
        ],
    );
    let grant = format!(
        "GRANT SELECT, UPDATE, DELETE ON {} TO {}",
        roles.table.qualified(),
        roles.relay
    );
    wait_until(
        Duration::from_secs(60),
        "the log names the GRANT",
        || async { logged(&roles.table, &grant) > 0 },
    )
    .await;
    let addr = http.clone();
    wait_until(Duration::from_secs(30), "/readyz answers 503", || {
        let addr = addr.clone();
        async move {
            tokio::task::spawn_blocking(move || http_status(&addr, "/readyz"))
                .await
                .unwrap()
                == Some(503)
        }
    })
    .await;
    assert_eq!(
        sink.received_count().await,
        0,
        "nothing claimed without UPDATE"
    );
    sqlx::query(&format!(
        "GRANT UPDATE ON {} TO {}",
        roles.table.qualified(),
        roles.relay
    ))
    .execute(&pg)
    .await
    .unwrap();
    sink.wait_all(&committed, Duration::from_secs(60)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let verdict = sink.judge(&committed).await;
    assert_eq!(
        (
            verdict.lost,
            verdict.order_violations,
            verdict.unexpected,
            verdict.duplicates
        ),
        (0, 0, 0, 0),
        "{verdict}"
    );
    let _ = std::fs::remove_dir_all(relay_log_dir(&roles.table));
    roles.drop_all(&pg).await;
}
