//! A database whose DBA chose other output settings and another language, on the database and on
//! the relay's role: `DateStyle = 'SQL, DMY'`, `IntervalStyle = 'sql_standard'`, `bytea_output =
//! 'escape'`, `TimeZone = 'Asia/Kolkata'`, `extra_float_digits = -3`, `lc_messages` German or
//! French. Every write form (the writer API with JSON and binary payloads, plain SQL, COPY, and under
//! the WAL source table-less events from the message writer and from plain SQL) is published once,
//! intact (every field as written, the creation time to the microsecond), in per-aggregate order,
//! with no dead letter, by the WAL source and by the polling source.
//!
//! Needs the de_DE and fr_FR locales (`scripts/test-env.sh` generates them) and `wal_level =
//! logical`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use txoutbox_core::testkit::ScriptedPublisher;
use txoutbox_core::{
    CancellationToken, Event, NewEvent, Relay, RelayConfig, Store, JSON_CONTENT_TYPE,
};
use txoutbox_postgres::testing::{database_url, fresh_table, pool};
use txoutbox_postgres::wal::{MessageWriter, WalConfig, WalStore};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore, Writer};
use uuid::Uuid;

/// The settings, on the database and on the role.
const SETTINGS: [(&str, &str); 5] = [
    ("DateStyle", "SQL, DMY"),
    ("IntervalStyle", "sql_standard"),
    ("bytea_output", "escape"),
    ("TimeZone", "Asia/Kolkata"),
    ("extra_float_digits", "-3"),
];

/// A database of its own and a login role of its own (allowed what the test's objects need: a
/// member of the role that owns them, with REPLICATION), both with [`SETTINGS`] and `lc_messages =
/// language`. Dropped at the end (`scripts/test-env.sh` drops those a stopped run left).
struct Hostile {
    database: String,
    role: String,
    admin: sqlx::PgPool,
}

impl Hostile {
    async fn create(language: &str) -> Hostile {
        let admin = pool(2).await;
        let suffix = &Uuid::new_v4().simple().to_string()[..10];
        let database = format!("outbox_hostile_{suffix}");
        let role = format!("outbox_dba_{suffix}");
        let mut sql = vec![
            format!("CREATE ROLE {role} LOGIN REPLICATION"),
            format!("GRANT postgres TO {role}"),
            format!("CREATE DATABASE {database}"),
        ];
        for (name, value) in SETTINGS.iter().chain([("lc_messages", language)].iter()) {
            sql.push(format!("ALTER DATABASE {database} SET {name} = '{value}'"));
            sql.push(format!("ALTER ROLE {role} SET {name} = '{value}'"));
        }
        for s in sql {
            sqlx::query(&s)
                .execute(&admin)
                .await
                .unwrap_or_else(|e| panic!("{s}: {e} (run `bash scripts/test-env.sh`: it generates the de_DE and fr_FR locales)"));
        }
        Hostile {
            database,
            role,
            admin,
        }
    }

    /// The test server's URL as the role, to the database.
    fn url(&self) -> String {
        let url = database_url();
        let (scheme, rest) = url.split_once("://").unwrap();
        let rest = rest.split_once('@').map_or(rest, |(_, h)| h);
        let (host, query) = rest
            .split_once('?')
            .map_or((rest, None), |(h, q)| (h, Some(q)));
        let host = host.split_once('/').map_or(host, |(h, _)| h);
        let query = query.map(|q| format!("?{q}")).unwrap_or_default();
        format!("{scheme}://{}@{host}/{}{query}", self.role, self.database)
    }

    async fn pool(&self, size: u32) -> sqlx::PgPool {
        connect(&self.url(), size).await.unwrap()
    }

    async fn drop_it(self) {
        // The reader's walsender may hold the slot a moment after the reader stopped.
        for _ in 0..100 {
            let left: Result<i64, _> = sqlx::query_scalar(
                "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots
                 WHERE database = $1 AND NOT active",
            )
            .bind(&self.database)
            .fetch_one(&self.admin)
            .await;
            let active: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE database = $1")
                    .bind(&self.database)
                    .fetch_one(&self.admin)
                    .await
                    .unwrap();
            if left.is_ok() && active == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for sql in [
            format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.database),
            format!("DROP ROLE IF EXISTS {}", self.role),
        ] {
            if let Err(e) = sqlx::raw_sql(&sql).execute(&self.admin).await {
                println!("{sql}: {e} (scripts/test-env.sh drops it)");
            }
        }
    }
}

/// An event as written: what the relay must publish.
#[derive(Debug, Clone)]
struct Written {
    id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: Payload,
    content_type: String,
    headers: BTreeMap<String, String>,
    /// The row's `created_at` (read back in binary), or for a table-less event the bounds of its
    /// commit time.
    created_at: CreatedAt,
}

#[derive(Debug, Clone)]
enum Payload {
    Json(serde_json::Value),
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone)]
enum CreatedAt {
    Exactly(DateTime<Utc>),
    Between(DateTime<Utc>, DateTime<Utc>),
}

impl Written {
    fn check(&self, e: &Event, what: &str) {
        let id = self.id;
        assert_eq!(e.aggregate_type, self.aggregate_type, "{what} {id}");
        assert_eq!(e.aggregate_id, self.aggregate_id, "{what} {id}");
        assert_eq!(e.event_type, self.event_type, "{what} {id}");
        assert_eq!(e.content_type, self.content_type, "{what} {id}");
        assert_eq!(e.headers, self.headers, "{what} {id}");
        match &self.payload {
            Payload::Json(v) => assert_eq!(
                &serde_json::from_slice::<serde_json::Value>(&e.payload).unwrap(),
                v,
                "{what} {id}"
            ),
            Payload::Bytes(b) => assert_eq!(&e.payload, b, "{what} {id}"),
        }
        match self.created_at {
            CreatedAt::Exactly(t) => assert_eq!(e.created_at, t, "{what} {id}"),
            CreatedAt::Between(a, b) => assert!(
                a <= e.created_at && e.created_at <= b,
                "{what} {id}: created {} outside its commit's [{a}, {b}]",
                e.created_at
            ),
        }
    }
}

/// A JSON payload with what output settings would change if it went through them as text.
fn json_payload(n: usize) -> serde_json::Value {
    serde_json::json!({
        "n": n,
        "price": 0.1,
        "tiny": 1.25e-7,
        "when": "2026-12-05T23:56:54.004345Z",
        "text": "Größe, café, \\x00ff",
    })
}

/// The rows of `table` with these aggregate ids, as written (read back in binary, unaffected by
/// the session's output settings).
async fn rows(
    tx: &mut sqlx::PgConnection,
    table: &OutboxTable,
    ids: &[Uuid],
) -> HashMap<Uuid, DateTime<Utc>> {
    sqlx::query_as::<_, (Uuid, DateTime<Utc>)>(&format!(
        "SELECT id, created_at FROM {} WHERE id = ANY($1)",
        table.qualified()
    ))
    .bind(ids)
    .fetch_all(tx)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// Writes `rounds` transactions over `aggregates` aggregates, every write form in each
/// (table-less ones when `table_less`). Returns what was written, in commit order.
async fn write(
    pg: &sqlx::PgPool,
    table: &OutboxTable,
    prefix: &str,
    table_less: bool,
    aggregates: usize,
    rounds: usize,
) -> Vec<Written> {
    let writer = Writer::new(table.clone());
    let messages = MessageWriter::new(prefix, table);
    let mut written = Vec::new();
    for round in 0..rounds {
        let mut tx = pg.begin().await.unwrap();
        let mut rows_written: Vec<Written> = Vec::new();
        let mut table_less_written: Vec<Written> = Vec::new();
        for a in 0..aggregates {
            let aggregate = format!("agg-{a}");
            let form = (round + a) % if table_less { 6 } else { 4 };
            let headers: BTreeMap<String, String> = [(
                "traceparent".to_string(),
                format!("00-{round:032x}-{a:016x}-01"),
            )]
            .into();
            match form {
                // The writer API, JSON payload.
                0 => {
                    let mut event =
                        NewEvent::new("order", &aggregate, "order.updated", json_payload(round));
                    event.headers = headers.clone();
                    writer.enqueue(&mut tx, event.clone()).await.unwrap();
                    rows_written.push(Written {
                        id: event.id,
                        aggregate_type: "order".into(),
                        aggregate_id: aggregate,
                        event_type: "order.updated".into(),
                        payload: Payload::Json(json_payload(round)),
                        content_type: JSON_CONTENT_TYPE.into(),
                        headers,
                        created_at: CreatedAt::Exactly(DateTime::<Utc>::default()),
                    });
                }
                // The writer API, binary payload: bytes bytea_output = 'escape' writes as escapes.
                1 => {
                    let data = vec![0u8, 0x5c, 0xff, b'A', 0x80, b'\'', round as u8];
                    let event = NewEvent::binary(
                        "scan",
                        &aggregate,
                        "scan.taken",
                        "application/octet-stream",
                        data.clone(),
                    );
                    writer.enqueue(&mut tx, event.clone()).await.unwrap();
                    rows_written.push(Written {
                        id: event.id,
                        aggregate_type: "scan".into(),
                        aggregate_id: aggregate,
                        event_type: "scan.taken".into(),
                        payload: Payload::Bytes(data),
                        content_type: "application/octet-stream".into(),
                        headers: BTreeMap::new(),
                        created_at: CreatedAt::Exactly(DateTime::<Utc>::default()),
                    });
                }
                // Plain SQL.
                2 => {
                    let id: Uuid = sqlx::query_scalar(&format!(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)
                         VALUES ('order', $1, 'order.priced', $2, $3) RETURNING id",
                        table.qualified()
                    ))
                    .bind(&aggregate)
                    .bind(json_payload(round))
                    .bind(serde_json::to_value(&headers).unwrap())
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                    rows_written.push(Written {
                        id,
                        aggregate_type: "order".into(),
                        aggregate_id: aggregate,
                        event_type: "order.priced".into(),
                        payload: Payload::Json(json_payload(round)),
                        content_type: JSON_CONTENT_TYPE.into(),
                        headers,
                        created_at: CreatedAt::Exactly(DateTime::<Utc>::default()),
                    });
                }
                // COPY.
                3 => {
                    let id = Uuid::now_v7();
                    let line = format!(
                        "{id}\torder\t{aggregate}\torder.copied\t{}\n",
                        json_payload(round).to_string().replace('\\', "\\\\")
                    );
                    let mut copy = (*tx)
                        .copy_in_raw(&format!(
                            "COPY {} (id, aggregate_type, aggregate_id, event_type, payload) FROM STDIN",
                            table.qualified()
                        ))
                        .await
                        .unwrap();
                    copy.send(line.as_bytes()).await.unwrap();
                    copy.finish().await.unwrap();
                    rows_written.push(Written {
                        id,
                        aggregate_type: "order".into(),
                        aggregate_id: aggregate,
                        event_type: "order.copied".into(),
                        payload: Payload::Json(json_payload(round)),
                        content_type: JSON_CONTENT_TYPE.into(),
                        headers: BTreeMap::new(),
                        created_at: CreatedAt::Exactly(DateTime::<Utc>::default()),
                    });
                }
                // A table-less event from the message writer, binary payload.
                4 => {
                    let data = vec![0u8, 0x5c, 0xff, round as u8];
                    let mut event = NewEvent::binary(
                        "scan",
                        &aggregate,
                        "scan.sent",
                        "application/octet-stream",
                        data.clone(),
                    );
                    event.headers = headers.clone();
                    messages.emit(&mut tx, event.clone()).await.unwrap();
                    table_less_written.push(Written {
                        id: event.id,
                        aggregate_type: "scan".into(),
                        aggregate_id: aggregate,
                        event_type: "scan.sent".into(),
                        payload: Payload::Bytes(data),
                        content_type: "application/octet-stream".into(),
                        headers,
                        created_at: CreatedAt::Between(Utc::now(), Utc::now()),
                    });
                }
                // A table-less event by plain SQL.
                _ => {
                    let id = Uuid::now_v7();
                    sqlx::query(
                        "SELECT pg_logical_emit_message(true, $1, jsonb_build_object(
                             'id', $2::text, 'aggregate_type', 'order', 'aggregate_id', $3::text,
                             'event_type', 'order.noted', 'payload', $4::jsonb)::text)",
                    )
                    .bind(prefix)
                    .bind(id.to_string())
                    .bind(&aggregate)
                    .bind(json_payload(round))
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                    table_less_written.push(Written {
                        id,
                        aggregate_type: "order".into(),
                        aggregate_id: aggregate,
                        event_type: "order.noted".into(),
                        payload: Payload::Json(json_payload(round)),
                        content_type: JSON_CONTENT_TYPE.into(),
                        headers: BTreeMap::new(),
                        created_at: CreatedAt::Between(Utc::now(), Utc::now()),
                    });
                }
            }
        }
        let ids: Vec<Uuid> = rows_written.iter().map(|w| w.id).collect();
        let created = rows(&mut tx, table, &ids).await;
        for w in &mut rows_written {
            w.created_at = CreatedAt::Exactly(created[&w.id]);
        }
        let before = Utc::now() - chrono::Duration::seconds(1);
        tx.commit().await.unwrap();
        let after = Utc::now() + chrono::Duration::seconds(1);
        for w in &mut table_less_written {
            w.created_at = CreatedAt::Between(before, after);
        }
        written.extend(rows_written);
        written.extend(table_less_written);
    }
    written
}

/// Writes every form into a table of `hostile`'s database as its role, relays it with the WAL
/// source (`wal`) or the polling source, and checks what was published.
async fn publishes_every_write_form_intact(wal: bool, language: &str) {
    let what = format!(
        "{} source, lc_messages {language}",
        if wal { "WAL" } else { "polling" }
    );
    let hostile = Hostile::create(language).await;
    let pg = hostile.pool(6).await;
    // sqlx pins DateStyle, TimeZone and extra_float_digits in its start-up message (the writer's
    // and the polling source's sessions); a replication connection takes the role's.
    let shown: (String, String, String) = sqlx::query_as(
        "SELECT current_setting('IntervalStyle'), current_setting('bytea_output'),
                current_setting('lc_messages')",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(
        shown,
        ("sql_standard".into(), "escape".into(), language.into()),
        "the role's sessions have the settings"
    );
    let set: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_db_role_setting s, unnest(s.setconfig) c
         WHERE s.setrole = (SELECT oid FROM pg_roles WHERE rolname = current_user)
            OR s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(set, 12, "six settings on the role and six on the database");
    let table = fresh_table(&pg).await;
    let prefix = table.schema().to_string();

    let publisher = ScriptedPublisher::new();
    let config = RelayConfig {
        batch_size: 50,
        ..RelayConfig::default()
    };
    let shutdown = CancellationToken::new();
    let (store, held, reader): (Arc<dyn Store>, PostgresStore, _) = if wal {
        let wal_config = WalConfig {
            message_prefix: prefix.clone(),
            ..WalConfig::default()
        };
        let slot = wal_config.slot(&table).unwrap();
        slot.setup(&pg).await.unwrap();
        let held_table = wal_config.held_table(&table).unwrap();
        migrate(&pg, &held_table).await.unwrap();
        let held = PostgresStore::new(pg.clone(), held_table);
        let store = WalStore::new(pg.clone(), slot, held.clone(), &wal_config)
            .unwrap()
            .with_held_poll_interval(Duration::from_millis(50));
        let reader = store.start();
        (Arc::new(store), held, Some(reader))
    } else {
        let store = PostgresStore::new(pg.clone(), table.clone());
        (Arc::new(store.clone()), store, None)
    };
    let relay = Relay::new(store.clone(), publisher.clone(), config).unwrap();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });

    let written = write(&pg, &table, &prefix, wal, 12, 8).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.pending == 0 && publisher.delivered().len() >= written.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {} of {} published, {} pending, {} dead letters",
            publisher.delivered().len(),
            written.len(),
            stats.pending,
            stats.dead_letters
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    let summary = run.await.unwrap();
    if let Some(reader) = reader {
        reader.stop().await;
    }
    assert_eq!(summary.dead_lettered, 0, "{what}: {summary:?}");
    assert_eq!(held.stats().await.unwrap().dead_letters, 0, "{what}");

    // Each event once, intact; each aggregate's in the order written.
    let delivered = publisher.delivered();
    let mut by_id: HashMap<Uuid, Vec<&Event>> = HashMap::new();
    for e in &delivered {
        by_id.entry(e.id).or_default().push(e);
    }
    for w in &written {
        match by_id.get(&w.id).map(Vec::as_slice) {
            Some([e]) => w.check(e, &what),
            other => panic!(
                "{what}: {} ({}) published {} times",
                w.id,
                w.event_type,
                other.map_or(0, <[_]>::len)
            ),
        }
    }
    assert_eq!(delivered.len(), written.len(), "{what}: nothing unexpected");
    // An aggregate is its type and id ("order" and "scan" of one id are two).
    let order = |events: Vec<((String, String), Uuid)>| {
        let mut by: HashMap<(String, String), Vec<Uuid>> = HashMap::new();
        for (a, id) in events {
            by.entry(a).or_default().push(id);
        }
        by
    };
    let expected = order(
        written
            .iter()
            .map(|w| ((w.aggregate_type.clone(), w.aggregate_id.clone()), w.id))
            .collect(),
    );
    let got = order(
        delivered
            .iter()
            .map(|e| ((e.aggregate_type.clone(), e.aggregate_id.clone()), e.id))
            .collect(),
    );
    // At most one event per aggregate per transaction: per-aggregate order is commit order.
    assert_eq!(got, expected, "{what}: per-aggregate order");
    println!(
        "{what}: {} events of {} write forms published intact",
        written.len(),
        if wal { 6 } else { 4 }
    );
    drop(pg);
    drop(store);
    drop(held);
    hostile.drop_it().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_source_under_german_messages_and_odd_output_settings() {
    publishes_every_write_form_intact(true, "de_DE.UTF-8").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_source_under_french_messages_and_odd_output_settings() {
    publishes_every_write_form_intact(true, "fr_FR.UTF-8").await;
}

/// The output settings alone, messages in English.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_source_under_odd_output_settings() {
    publishes_every_write_form_intact(true, "C").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_polling_source_under_german_messages_and_odd_output_settings() {
    publishes_every_write_form_intact(false, "de_DE.UTF-8").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_polling_source_under_french_messages_and_odd_output_settings() {
    publishes_every_write_form_intact(false, "fr_FR.UTF-8").await;
}
