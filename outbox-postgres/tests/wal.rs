//! The WAL source's slot against the real PostgreSQL (`wal_level = logical`, set by
//! `scripts/test-env.sh`): setup, status and drop.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_core::testkit::sample_event;
use txoutbox_core::testkit::TestStore;
use txoutbox_core::ErrorKind;
use txoutbox_postgres::testing::{fresh_table, pool, PgTestStore};
use txoutbox_postgres::wal::{self, WalSlot};
use txoutbox_postgres::{OutboxTable, PostgresStore};

/// Drops the slot at the end of the test, failed or not: a forgotten slot keeps WAL for ever.
struct Dropped(WalSlot, sqlx::PgPool);

impl Drop for Dropped {
    fn drop(&mut self) {
        let (slot, pool) = (self.0.clone(), self.1.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(async move { slot.drop(&pool).await })
        })
        .join();
    }
}

/// A fresh outbox table with its slot set up, under a message prefix of its own (messages are
/// database-wide: the prefix keeps other tests' messages out); the slot is dropped with the guard.
async fn table_with_slot(pool: &sqlx::PgPool) -> (OutboxTable, WalSlot, String, Dropped) {
    logical(pool).await;
    let table = fresh_table(pool).await;
    let prefix = table.schema().to_string();
    let slot = WalSlot::new(table.clone(), None, None)
        .unwrap()
        .with_message_prefix(prefix.clone());
    let guard = Dropped(slot.clone(), pool.clone());
    slot.setup(pool).await.unwrap();
    (table, slot, prefix, guard)
}

async fn logical(pool: &sqlx::PgPool) {
    let level = wal::wal_level(pool).await.unwrap();
    assert_eq!(
        level, "logical",
        "the WAL tests need wal_level = logical: run `bash scripts/test-env.sh` (it sets it and restarts the local server once)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_status_and_drop_of_a_tables_slot() {
    let pool = pool(4).await;
    logical(&pool).await;
    let table = fresh_table(&pool).await;
    let slot = WalSlot::new(table.clone(), None, None)
        .unwrap()
        .with_message_prefix(table.schema());
    let _guard = Dropped(slot.clone(), pool.clone());

    let before = slot.status(&pool).await.unwrap();
    assert!(
        !before.slot_exists && !before.publication_exists,
        "{before:?}"
    );
    assert_eq!(before.wal_level, "logical");

    let created = slot.setup(&pool).await.unwrap();
    assert!(created.publication && created.slot, "{created:?}");
    let again = slot.setup(&pool).await.unwrap();
    assert!(!again.publication && !again.slot, "idempotent: {again:?}");

    let idle = slot.status(&pool).await.unwrap();
    assert!(
        idle.slot_exists && idle.publication_exists && !idle.active,
        "{idle:?}"
    );
    assert!(idle.confirmed_lsn.is_some() && idle.restart_lsn.is_some());
    // Creating the slot wrote WAL after its restart position: the slot keeps some.
    assert!(idle.retained_bytes.unwrap() > 0, "{idle:?}");
    assert_eq!(
        idle.lag_seconds,
        Some(0.0),
        "nothing committed since: {idle:?}"
    );
    assert_eq!(idle.oldest_unconfirmed_commit, None);

    // Events committed into the table: the slot holds them, the lag counts from the first commit.
    let written = chrono::Utc::now();
    let store = PgTestStore::new(PostgresStore::new(pool.clone(), table.clone()));
    store
        .insert(vec![sample_event("a", 0), sample_event("a", 1)])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let behind = slot.status(&pool).await.unwrap();
    let first = behind
        .oldest_unconfirmed_commit
        .expect("a transaction held");
    assert!(
        first >= written - chrono::Duration::seconds(1) && first <= chrono::Utc::now(),
        "{first} vs {written}"
    );
    assert!(behind.lag_seconds.unwrap() > 0.0, "{behind:?}");
    assert!(
        behind.lag_bytes.unwrap() > idle.lag_bytes.unwrap(),
        "{behind:?}"
    );
    // Peeking for the status consumed nothing.
    let still = slot.status(&pool).await.unwrap();
    assert_eq!(still.oldest_unconfirmed_commit, Some(first));
    assert!(!still.retains_too_much(wal::DEFAULT_RETAINED_WAL_WARNING));
    assert!(still.retains_too_much(0), "any WAL is more than none");

    let dropped = slot.drop(&pool).await.unwrap();
    assert!(dropped.slot && dropped.publication, "{dropped:?}");
    let gone = slot.status(&pool).await.unwrap();
    assert!(!gone.slot_exists && !gone.publication_exists, "{gone:?}");
    let again = slot.drop(&pool).await.unwrap();
    assert!(!again.slot && !again.publication);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_of_an_unmigrated_table_says_to_migrate() {
    let pool = pool(2).await;
    logical(&pool).await;
    let table = txoutbox_postgres::testing::unmigrated_table();
    let slot = WalSlot::new(table, None, None).unwrap();
    let _guard = Dropped(slot.clone(), pool.clone());
    let e = slot.setup(&pool).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("run `outbox migrate`"), "{e}");
    let status = slot.status(&pool).await.unwrap();
    assert!(
        !status.slot_exists,
        "no slot without its publication: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_rows_and_messages_come_out_in_commit_order_until_confirmed() {
    use txoutbox_core::{NewEvent, Payload};
    use txoutbox_postgres::wal::{MessageWriter, WalItem, WalReader};
    use txoutbox_postgres::Writer;
    let pool = pool(4).await;
    let (table, slot, prefix, _guard) = table_with_slot(&pool).await;
    let reader = WalReader::new(slot.clone());
    let writer = Writer::new(table.clone());
    let messages = MessageWriter::new(prefix.clone(), &table);
    // What this outbox holds (transactions of other tests' messages come with no items).
    let ours = |peek: txoutbox_postgres::wal::WalPeek| -> Vec<_> {
        assert!(!peek.cut, "a read of everything");
        assert!(
            peek.idle_lsn.is_some(),
            "an uncut read says where an idle slot may go"
        );
        peek.transactions
            .into_iter()
            .filter(|t| !t.items.is_empty())
            .collect()
    };

    // 1: the writer API, a JSON event with a header and a binary one.
    let json = NewEvent::new(
        "order",
        "a",
        "order.created",
        serde_json::json!({"total": 9, "note": "Zoë"}),
    )
    .with_header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let mut binary = NewEvent::new("order", "a", "order.scanned", serde_json::Value::Null);
    binary.payload = Payload::Binary {
        content_type: "application/x-protobuf".into(),
        data: vec![0, 1, 0xfe, 0xff],
    };
    let mut tx = pool.begin().await.unwrap();
    writer
        .enqueue_many(&mut tx, vec![json.clone(), binary.clone()])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // 2: plain SQL, a table-less event through the API and one from plain SQL without an id.
    let tableless = NewEvent::new("invoice", "c", "invoice.sent", serde_json::json!([1, 2]))
        .with_destination("billing");
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'b', 'order.paid', '{{\"by\": \"card\"}}')",
        table.qualified()
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    messages.emit(&mut tx, tableless.clone()).await.unwrap();
    sqlx::query("SELECT pg_logical_emit_message(true, $1, json_build_object('aggregate_type', 'cart', 'aggregate_id', 'd', 'event_type', 'cart.emptied', 'payload', json_build_object('items', 0))::text)")
        .bind(&prefix)
        .execute(&mut *tx)
        .await
        .unwrap();
    // Another prefix is not ours.
    sqlx::query("SELECT pg_logical_emit_message(true, 'someone-else', 'x')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // 3: rolled back, so never an event.
    let mut tx = pool.begin().await.unwrap();
    writer
        .enqueue(
            &mut tx,
            NewEvent::new("order", "z", "order.lost", serde_json::json!({})),
        )
        .await
        .unwrap();
    messages
        .emit(
            &mut tx,
            NewEvent::new("order", "z", "order.lost", serde_json::json!({})),
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // 4: a message that cannot be an event.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_logical_emit_message(true, $1, 'not json')")
        .bind(&prefix)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let txs = ours(reader.peek(&pool, 1000).await.unwrap());
    assert_eq!(txs.len(), 3, "three committed transactions: {txs:#?}");
    assert!(txs[0].end_lsn < txs[1].end_lsn && txs[1].end_lsn < txs[2].end_lsn);
    let events = |i: usize| -> Vec<txoutbox_core::Event> {
        txs[i]
            .items
            .iter()
            .map(|item| match item {
                WalItem::Event(e) => e.clone(),
                other => panic!("not an event: {other:?}"),
            })
            .collect()
    };
    let first = events(0);
    assert_eq!(first.len(), 2);
    assert_eq!(first[0].id, json.id);
    assert_eq!(first[0].event_type, "order.created");
    let payload: serde_json::Value = serde_json::from_slice(&first[0].payload).unwrap();
    assert_eq!(payload, serde_json::json!({"total": 9, "note": "Zoë"}));
    assert_eq!(first[0].headers, json.headers);
    assert_eq!(first[0].content_type, "application/json");
    let stored: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(&format!(
        "SELECT created_at FROM {} WHERE id = $1",
        table.qualified()
    ))
    .bind(json.id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(first[0].created_at, stored, "the row's own creation time");
    assert_eq!(first[1].id, binary.id);
    assert_eq!(first[1].payload, vec![0, 1, 0xfe, 0xff]);
    assert_eq!(first[1].content_type, "application/x-protobuf");

    let second = events(1);
    assert_eq!(second.len(), 3, "{second:#?}");
    assert_eq!(
        (
            second[0].aggregate_id.as_str(),
            second[0].event_type.as_str()
        ),
        ("b", "order.paid")
    );
    assert_eq!(second[1].id, tableless.id);
    assert_eq!(second[1].destination.as_deref(), Some("billing"));
    assert_eq!(second[1].payload, b"[1,2]");
    assert_eq!(
        second[1].created_at, txs[1].commit_time,
        "a message is created when it commits"
    );
    assert_eq!(second[2].event_type, "cart.emptied");
    let again = ours(reader.peek(&pool, 1000).await.unwrap());
    assert_eq!(
        again[1].items[2], txs[1].items[2],
        "an event without an id gets the same one on every read"
    );
    match &txs[2].items[..] {
        [WalItem::Undecodable { error, raw, .. }] => {
            assert!(error.contains("not a JSON object"), "{error}");
            assert_eq!(raw, "not json");
        }
        other => panic!("{other:?}"),
    }

    // Nothing is consumed until confirmed; confirming moves past whole transactions, never back.
    assert_eq!(again, txs);
    reader.confirm(&pool, txs[0].end_lsn).await.unwrap();
    let rest = ours(reader.peek(&pool, 1000).await.unwrap());
    assert_eq!(rest, txs[1..].to_vec());
    reader.confirm(&pool, txs[2].end_lsn).await.unwrap();
    reader.confirm(&pool, txs[0].end_lsn).await.unwrap();
    assert!(ours(reader.peek(&pool, 1000).await.unwrap()).is_empty());
    let status = slot.status(&pool).await.unwrap();
    assert_eq!(status.oldest_unconfirmed_commit, None);
}

/// Slot names are server-wide: a slot of the same name in another database is never taken, shown
/// or dropped as this outbox's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_of_the_same_name_in_another_database_is_refused() {
    let pool = pool(2).await;
    logical(&pool).await;
    let table = fresh_table(&pool).await;
    let slot = WalSlot::new(table.clone(), None, None).unwrap();
    let url = txoutbox_postgres::testing::database_url();
    let (base, _) = url.rsplit_once('/').unwrap();
    let other = txoutbox_postgres::connect(&format!("{base}/postgres"), 1)
        .await
        .unwrap();
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(slot.slot())
        .execute(&other)
        .await
        .unwrap();
    let (slot2, pool2) = (slot.clone(), pool.clone());
    let result = async move {
        let (slot, pool) = (slot2, pool2);
        let e = slot.setup(&pool).await.unwrap_err();
        assert!(
            e.message().contains("database postgres") && e.message().contains("wal.slot"),
            "{e}"
        );
        let e = slot.status(&pool).await.unwrap_err();
        assert!(e.message().contains("already exists on this server"), "{e}");
        let e = slot.drop(&pool).await.unwrap_err();
        assert!(e.message().contains("wal.slot"), "{e}");
    };
    let outcome = tokio::spawn(result).await;
    let still: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(slot.slot())
    .fetch_one(&other)
    .await
    .unwrap();
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(slot.slot())
        .execute(&other)
        .await
        .unwrap();
    outcome.unwrap();
    assert!(still, "the other database's slot was left alone");
}

/// Setup repairs what it can and refuses what would lose events: a publication that lost the table
/// (dropped and made again) gets it back; a slot whose publication is gone is refused, naming the
/// fix; two setups at once both succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_repairs_or_refuses_a_broken_pair_and_runs_twice_at_once() {
    let pool = pool(4).await;
    logical(&pool).await;
    let table = fresh_table(&pool).await;
    let slot = WalSlot::new(table.clone(), None, None).unwrap();
    let _guard = Dropped(slot.clone(), pool.clone());
    // Several rounds: the two setups interleave differently each time.
    for round in 0..5 {
        if round > 0 {
            slot.drop(&pool).await.unwrap();
        }
        let (a, b) = tokio::join!(slot.setup(&pool), slot.setup(&pool));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(a.slot ^ b.slot, "one of them made the slot: {a:?} {b:?}");
        assert!(slot.status(&pool).await.unwrap().covers_table);
    }

    sqlx::query(&format!(
        "ALTER PUBLICATION \"{}\" DROP TABLE {}",
        slot.publication(),
        table.qualified()
    ))
    .execute(&pool)
    .await
    .unwrap();
    let broken = slot.status(&pool).await.unwrap();
    assert!(
        !broken.covers_table && broken.lag_seconds.is_none(),
        "{broken:?}"
    );
    assert!(broken
        .lag_unknown
        .unwrap()
        .contains("does not hold the outbox table"));
    assert!(
        slot.setup(&pool).await.unwrap().publication,
        "the table is added back"
    );
    assert!(slot.status(&pool).await.unwrap().covers_table);

    sqlx::query(&format!("DROP PUBLICATION \"{}\"", slot.publication()))
        .execute(&pool)
        .await
        .unwrap();
    let e = slot.setup(&pool).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("outbox wal drop --yes"), "{e}");
}

/// The columns are read the same whatever the session's output settings (a role or database may set
/// bytea_output = escape).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_decode_whatever_the_sessions_output_settings() {
    use txoutbox_core::{NewEvent, Payload};
    use txoutbox_postgres::wal::{WalItem, WalReader};
    let url = txoutbox_postgres::testing::database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    let odd = txoutbox_postgres::connect(
        &format!("{url}{separator}options=-c%20bytea_output%3Descape%20-c%20DateStyle%3DSQL%2CDMY%20-c%20TimeZone%3DAmerica%2FSt_Johns"),
        2,
    )
    .await
    .unwrap();
    let setting: String = sqlx::query_scalar("SHOW bytea_output")
        .fetch_one(&odd)
        .await
        .unwrap();
    assert_eq!(setting, "escape", "the session's settings are odd indeed");
    logical(&odd).await;
    let table = fresh_table(&odd).await;
    let slot = WalSlot::new(table.clone(), None, None)
        .unwrap()
        .with_message_prefix(table.schema());
    let _guard = Dropped(slot.clone(), odd.clone());
    slot.setup(&odd).await.unwrap();
    let mut event = NewEvent::new("order", "a", "order.scanned", serde_json::Value::Null);
    event.payload = Payload::Binary {
        content_type: "application/octet-stream".into(),
        data: vec![0, 0x5c, 0xff, b'A'],
    };
    let mut tx = odd.begin().await.unwrap();
    txoutbox_postgres::Writer::new(table.clone())
        .enqueue(&mut tx, event.clone())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let peek = WalReader::new(slot.clone()).peek(&odd, 1000).await.unwrap();
    let got: Vec<_> = peek
        .transactions
        .iter()
        .flat_map(|t| t.items.iter())
        .collect();
    match &got[..] {
        [WalItem::Event(e)] => {
            assert_eq!(e.payload, vec![0, 0x5c, 0xff, b'A']);
            let stored: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(&format!(
                "SELECT created_at FROM {} WHERE id = $1",
                table.qualified()
            ))
            .bind(event.id)
            .fetch_one(&odd)
            .await
            .unwrap();
            assert_eq!(e.created_at, stored);
        }
        other => panic!("{other:?}"),
    }
}

/// The WAL source's store passes the conformance suite every store passes (its events come from
/// the slot; failures go to the held table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_store_passes_the_store_conformance_suite() {
    let pool = pool(16).await;
    logical(&pool).await;
    txoutbox_core::testkit::store_suite::run_all(&txoutbox_postgres::testing::WalFixture { pool })
        .await;
}

/// The README's statement between `<!-- sql:NAME -->` markers.
fn readme_sql(name: &str) -> String {
    let readme = include_str!("../README.md");
    let start = readme
        .find(&format!("<!-- sql:{name} -->"))
        .unwrap_or_else(|| panic!("README.md has no sql:{name} block"));
    let block = &readme[start..];
    let end = block.find(&format!("<!-- /sql:{name} -->")).unwrap();
    block[..end]
        .lines()
        .skip_while(|l| !l.starts_with("```sql"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The README's recipe for services on other clients: its row insert and its table-less message,
/// run as they stand (the default table and prefix swapped for this test's), in one transaction,
/// come out of the slot as the two events, in that order, with the fields bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_plain_sql_recipes_write_events_the_relay_reads() {
    use txoutbox_postgres::wal::{WalItem, WalReader};
    let pool = pool(4).await;
    let (table, slot, prefix, _guard) = table_with_slot(&pool).await;
    let row_sql = readme_sql("row").replace("outbox_events", &table.qualified());
    let tableless_sql = readme_sql("tableless").replace("'outbox'", &format!("'{prefix}'"));
    assert!(row_sql.starts_with("INSERT INTO") && tableless_sql.contains(&prefix));
    let id = uuid::Uuid::new_v4();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&row_sql)
        .bind("order")
        .bind("42")
        .bind("order.created")
        .bind(serde_json::json!({"total": 99}))
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(&tableless_sql)
        .bind(id)
        .bind("order")
        .bind("42")
        .bind("order.paid")
        .bind(serde_json::json!({"by": "card"}))
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let peek = WalReader::new(slot.clone())
        .peek(&pool, 1000)
        .await
        .unwrap();
    let events: Vec<txoutbox_core::Event> = peek
        .transactions
        .into_iter()
        .flat_map(|t| t.items)
        .map(|item| match item {
            WalItem::Event(e) => e,
            other => panic!("not an event: {other:?}"),
        })
        .collect();
    assert_eq!(events.len(), 2, "{events:?}");
    let fields = |e: &txoutbox_core::Event| {
        (
            e.aggregate_type.clone(),
            e.aggregate_id.clone(),
            e.event_type.clone(),
            serde_json::from_slice::<serde_json::Value>(&e.payload).unwrap(),
        )
    };
    assert_eq!(
        fields(&events[0]),
        (
            "order".into(),
            "42".into(),
            "order.created".into(),
            serde_json::json!({"total": 99})
        )
    );
    assert_eq!(
        fields(&events[1]),
        (
            "order".into(),
            "42".into(),
            "order.paid".into(),
            serde_json::json!({"by": "card"})
        )
    );
    assert_eq!(events[1].id, id);
}
