//! Loading and checking the configuration: defaults, the environment over the file, errors that
//! name the key, the relay's pool, the message format, redaction.

use std::path::Path;

use txoutbox_core::format::MessageFormat;

use super::*;

fn load_str(toml_text: &str, env: &[(&str, &str)]) -> Result<Config, Error> {
    let dir = std::env::temp_dir().join(format!("outbox-config-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("outbox.toml");
    std::fs::write(&path, toml_text).unwrap();
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let r = Config::load(Some(&path), env);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

#[test]
fn the_liveness_timeout_follows_the_hold_time_unless_set() {
    let c = Config::load(None, Vec::new()).unwrap();
    assert_eq!(c.liveness_timeout(), Duration::from_secs(300));
    // A long publish timeout (as a Kafka delivery timeout of 300 s needs) still loads.
    let c = load_str("[relay]\npublish_timeout = \"320s\"\n", &[]).unwrap();
    assert_eq!(c.liveness_timeout(), Duration::from_secs(650 + 60));
    let e = load_str(
        "[relay]\npublish_timeout = \"320s\"\n[http]\nliveness_timeout = \"10m\"\n",
        &[],
    )
    .unwrap_err();
    assert!(
        e.message().contains("http.liveness_timeout = 10m")
            && e.message().contains("hold time, 650s"),
        "{e}"
    );
    let c = load_str("[http]\nliveness_timeout = \"20m\"\n", &[]).unwrap();
    assert_eq!(c.liveness_timeout(), Duration::from_secs(1200));
}

#[test]
fn no_file_means_defaults() {
    let c = Config::load(None, Vec::new()).unwrap();
    assert_eq!(c.publisher.kind, PublisherType::Stdout);
    assert_eq!(c.relay.batch_size, 500);
    assert_eq!(c.database.table, "outbox_events");
}

#[test]
fn env_overrides_the_file() {
    let c = load_str(
        "[relay]\nbatch_size = 100\n[database]\nurl = \"postgres://a@h/db\"\n",
        &[
            ("OUTBOX_RELAY__BATCH_SIZE", "250"),
            ("OUTBOX_RELAY__RETRY__MAX_ATTEMPTS", "3"),
            ("OUTBOX_RELAY__POLL_INTERVAL", "2s"),
            ("DATABASE_URL", "postgres://b@h/db"),
            ("UNRELATED", "x"),
        ],
    )
    .unwrap();
    assert_eq!(c.relay.batch_size, 250);
    assert_eq!(c.relay.retry.max_attempts, 3);
    assert_eq!(c.relay.poll_interval, Duration::from_secs(2));
    assert_eq!(c.database.url, "postgres://b@h/db");
    let c = load_str(
        "[publisher]\ntype = \"kafka\"\n",
        &[("OUTBOX_KAFKA__ALLOWED_DESTINATIONS", "audit.*, orders.v2")],
    );
    #[cfg(feature = "kafka")]
    assert_eq!(
        c.unwrap().kafka.allowed_destinations,
        vec!["audit.*".to_string(), "orders.v2".to_string()],
        "a list from the environment is comma-separated"
    );
    #[cfg(not(feature = "kafka"))]
    drop(c);
    let c = load_str(
        "",
        &[
            ("DATABASE_URL", "postgres://b@h/db"),
            ("OUTBOX_DATABASE__URL", "postgres://c@h/db"),
        ],
    )
    .unwrap();
    assert_eq!(
        c.database.url, "postgres://c@h/db",
        "OUTBOX_DATABASE__URL wins over DATABASE_URL"
    );
}

#[test]
fn digits_stay_text_where_text_is_expected() {
    let c = load_str(
        "",
        &[
            ("OUTBOX_DATABASE__SCHEMA", "s123"),
            ("OUTBOX_LOG__LEVEL", "3"),
        ],
    )
    .unwrap();
    assert_eq!(c.log.level, "3");
}

/// The environment never changes a setting's text: a text key takes the variable whole, leading
/// zeros and trailing decimals included, and a password of digits is a password.
#[test]
fn text_settings_from_the_environment_keep_their_exact_text() {
    let c = load_str(
        "",
        &[
            ("OUTBOX_KAFKA__TOPIC", "0042"),
            ("OUTBOX_AMQP__EXCHANGE", "1.10"),
            ("OUTBOX_KAFKA__PROPERTIES__SASL__PASSWORD", "0123"),
            ("OUTBOX_RELAY__BATCH_SIZE", "0250"),
        ],
    )
    .unwrap();
    assert_eq!(c.relay.batch_size, 250, "a number key parses the text");
    #[cfg(feature = "kafka")]
    {
        assert_eq!(c.kafka.topic, "0042");
        assert_eq!(
            c.kafka.properties.get("sasl.password").map(String::as_str),
            Some("0123")
        );
    }
    #[cfg(feature = "amqp")]
    assert_eq!(c.amqp.exchange, "1.10");
    let e = load_str("", &[("OUTBOX_RELAY__BATCH_SIZE", "25O")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("relay.batch_size")
            && e.contains("OUTBOX_RELAY__BATCH_SIZE")
            && e.contains("\"25O\""),
        "a number key refuses a text that is not one, naming the variable and its text: {e}"
    );
}

#[test]
fn errors_name_the_key_the_value_and_the_source() {
    let e = load_str("[relay]\nbatch_siz = 10\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("relay") && e.contains("unknown field `batch_siz`"),
        "{e}"
    );
    let e = load_str("[relay]\nbatch_size = \"lots\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("relay.batch_size") && e.contains("invalid type"),
        "{e}"
    );
    let e = load_str("", &[("OUTBOX_RELAY__BATCH_SIZE", "lots")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("relay.batch_size (from OUTBOX_RELAY__BATCH_SIZE)"),
        "{e}"
    );
    let e = load_str("[relay]\nbatch_size = 0\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("relay.batch_size = 0: expected 1 to 100000"),
        "{e}"
    );
    let e = load_str("[relay]\npoll_interval = \"soon\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("relay.poll_interval") && e.contains("not a duration"),
        "{e}"
    );
    let e = load_str("[publisher]\ntype = \"carrier-pigeon\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("publisher.type") && e.contains("unknown variant"),
        "{e}"
    );
    #[cfg(not(feature = "sqs"))]
    {
        let e = load_str("[publisher]\ntype = \"sqs\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("built without the `sqs` feature"), "{e}");
    }
    let e = load_str(
        "[publisher]\ntype = \"sqs\"\n[sqs]\nmax_message_bytes = 1\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("sqs.max_message_bytes") || e.contains("built without the `sqs` feature"),
        "{e}"
    );
    let e = load_str("not toml = = 1", &[]).unwrap_err().to_string();
    assert!(e.contains("is not valid TOML"), "{e}");
    let e = Config::load(Some(Path::new("/nonexistent/outbox.toml")), Vec::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot read the configuration file /nonexistent/outbox.toml"),
        "{e}"
    );
    // Only the relay needs its whole pool: any other subcommand loads the same file.
    let relay_pool = |toml: &str, env: &[(&str, &str)]| {
        load_str(toml, env).and_then(|c| c.check_relay_pool().map(|()| c))
    };
    assert!(load_str(
        "[database]\npool_size = 2\n[relay]\nmax_in_flight = 4\n",
        &[]
    )
    .is_ok());
    let e = relay_pool(
        "[database]\npool_size = 2\n[relay]\nmax_in_flight = 4\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("database.pool_size = 2 is too small"), "{e}");
    // One formula counts every user of the pool: batches, statistics, readiness, listener.
    let ok = relay_pool(
        "[database]\npool_size = 4\n[relay]\nmax_in_flight = 2\n",
        &[],
    );
    assert!(ok.is_ok(), "{ok:?}");
    let e = relay_pool(
        "[database]\npool_size = 4\nnotify = true\n[relay]\nmax_in_flight = 2\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("+ 1 (the NOTIFY listener, database.notify = true) = 5 connections"),
        "{e}"
    );
    let e = relay_pool(
        "[database]\npool_size = 3\n[relay]\nmax_in_flight = 2\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("set database.pool_size to at least 4"), "{e}");
    // Kept rows cleaned by the relay: one more connection, named; none when cleaned by hand.
    let keep =
        "[database]\npool_size = 4\nkeep_processed_for = \"1d\"\n[relay]\nmax_in_flight = 2\n";
    let e = relay_pool(keep, &[]).unwrap_err().to_string();
    assert!(
        e.contains("+ 1 (automatic cleanup, database.keep_processed_for with database.auto_cleanup = true) = 5 connections"),
        "{e}"
    );
    let by_hand = keep.replace("[relay]", "auto_cleanup = false\n[relay]");
    assert!(relay_pool(&by_hand, &[]).is_ok());
}

#[test]
fn the_message_format_is_checked() {
    let c = load_str(
        "[publisher]\ntype = \"kafka\"\nformat = \"cloudevents-structured\"\n",
        &[],
    )
    .unwrap();
    assert_eq!(
        c.publisher.formatter().unwrap().format(),
        MessageFormat::CloudeventsStructured
    );
    let e = load_str("[publisher]\ntype = \"kafka\"\nformat = \"avro\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("publisher.format") && e.contains("cloudevents-binary"),
        "{e}"
    );
    let e = load_str("", &[("OUTBOX_PUBLISHER__FORMAT", "debezium")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the stdout publisher prints each event as a JSON line"),
        "{e}"
    );
    let e = load_str(
        "[publisher]\ntype = \"sqs\"\nformat = \"cloudevents-binary\"\ncloudevents_source = \"/{tenant}\"\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("publisher.cloudevents_source"), "{e}");
}

#[test]
fn secrets_never_show() {
    let c = load_str(
        "[database]\nurl = \"postgres://app:hunter2@db/shop\"\n",
        &[],
    )
    .unwrap();
    assert!(!format!("{c:?}").contains("hunter2"));
    assert!(!c.to_redacted_toml().contains("hunter2"));
    assert!(c.to_redacted_toml().contains("app:***@db"));
}

#[test]
fn only_outbox_section_key_variables_configure_others_are_ignored() {
    // What Kubernetes gives every container for a Service named outbox-relay (and outbox).
    let links = [
        ("OUTBOX_RELAY_SERVICE_HOST", "10.96.12.34"),
        ("OUTBOX_RELAY_SERVICE_PORT", "9464"),
        ("OUTBOX_RELAY_SERVICE_PORT_HTTP", "9464"),
        ("OUTBOX_RELAY_PORT", "tcp://10.96.12.34:9464"),
        ("OUTBOX_RELAY_PORT_9464_TCP", "tcp://10.96.12.34:9464"),
        ("OUTBOX_RELAY_PORT_9464_TCP_PROTO", "tcp"),
        ("OUTBOX_RELAY_PORT_9464_TCP_PORT", "9464"),
        ("OUTBOX_RELAY_PORT_9464_TCP_ADDR", "10.96.12.34"),
        ("OUTBOX_PORT", "tcp://10.96.40.2:8080"),
    ];
    let mut env = links.to_vec();
    env.push(("OUTBOX_RELAY__BATCH_SIZE", "250"));
    let c = load_str("", &env).unwrap();
    assert_eq!(c.relay.batch_size, 250, "the documented form still applies");
    assert_eq!(c, {
        let mut d = load_str("", &[]).unwrap();
        d.relay.batch_size = 250;
        d
    });
    let names: Vec<&str> = env.iter().map(|(k, _)| *k).collect();
    let ignored = ignored(names.iter().copied());
    assert_eq!(ignored, links.iter().map(|(k, _)| *k).collect::<Vec<_>>());
    assert!(
        links.iter().all(|(k, _)| service_link(k)),
        "every link variable is known as one"
    );
    for typo in [
        "OUTBOX_RELAY_BATCH_SIZE",
        "OUTBOX_DATABASE_URL",
        "OUTBOX_KAFKA_BROKERS",
    ] {
        assert!(!service_link(typo), "{typo} is warned of as a likely typo");
    }
    assert_eq!(
        setting("OUTBOX_RELAY__BATCH_SIZE"),
        Some("RELAY__BATCH_SIZE")
    );
    assert_eq!(setting("OUTBOX_RELAY_PORT"), None);
    assert_eq!(setting("DATABASE_URL"), None);
    // A variable of the form with an empty part is still a mistake named as one.
    let e = load_str("", &[("OUTBOX_RELAY____BATCH_SIZE", "1")]).unwrap_err();
    assert!(
        e.message().contains("expected OUTBOX_<SECTION>__<KEY>"),
        "{}",
        e.message()
    );
}

#[cfg(feature = "kafka")]
#[test]
fn the_kafka_size_key_is_max_message_bytes_from_the_environment_too() {
    let c = load_str("", &[("OUTBOX_KAFKA__MAX_MESSAGE_BYTES", "2000000")]).unwrap();
    assert_eq!(c.kafka.max_message_bytes, 2_000_000);
    let e = load_str("", &[("OUTBOX_KAFKA__MESSAGE_MAX_BYTES", "2000000")]).unwrap_err();
    assert!(
        e.message().contains("use kafka.max_message_bytes"),
        "{}",
        e.message()
    );
    let e = load_str("[kafka]\nmessage_max_bytes = 2000000\n", &[]).unwrap_err();
    assert!(
        e.message().contains("use kafka.max_message_bytes"),
        "{}",
        e.message()
    );
}

#[test]
fn durations_need_a_unit_and_log_levels_must_be_levels() {
    for (toml, env) in [
        ("[relay]\npoll_interval = 500\n", vec![]),
        ("", vec![("OUTBOX_RELAY__POLL_INTERVAL", "500")]),
    ] {
        let e = load_str(toml, &env).unwrap_err().to_string();
        assert!(
            e.contains("poll_interval") && e.contains("no unit") && e.contains("500ms, 500s"),
            "{e}"
        );
    }
    let c = load_str("[relay]\npoll_interval = \"500ms\"\n", &[]).unwrap();
    assert_eq!(c.relay.poll_interval, Duration::from_millis(500));
    let e = load_str("[log]\nlevel = \"verbose\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("log.level") && e.contains("\"verbose\" is not a level"),
        "{e}"
    );
    let e = load_str("", &[("OUTBOX_LOG__LEVEL", "txoutbox_core=loud,info")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"txoutbox_core=loud\""), "{e}");
    for ok in [
        "info",
        "DEBUG",
        "txoutbox_core=debug,info",
        "warn,sqlx::query=error",
        "off",
    ] {
        let c = load_str("", &[("OUTBOX_LOG__LEVEL", ok)]).unwrap();
        assert_eq!(c.log.level, ok);
    }
}

#[test]
fn kafka_properties_from_a_shell_exportable_variable() {
    let c = load_str(
        "",
        &[
            ("OUTBOX_KAFKA__PROPERTIES__SASL__PASSWORD", "s3cret"),
            ("OUTBOX_KAFKA__PROPERTIES__SSL__CA__LOCATION", "/etc/ca.pem"),
            ("OUTBOX_KAFKA__PROPERTIES__SECURITY.PROTOCOL", "sasl_ssl"),
            ("OUTBOX_KAFKA__PROPERTIES__LOG_LEVEL", "6"),
        ],
    )
    .unwrap();
    let p = &c.kafka.properties;
    assert_eq!(p.get("sasl.password").map(String::as_str), Some("s3cret"));
    assert_eq!(
        p.get("ssl.ca.location").map(String::as_str),
        Some("/etc/ca.pem")
    );
    assert_eq!(
        p.get("security.protocol").map(String::as_str),
        Some("sasl_ssl")
    );
    assert_eq!(p.get("log_level").map(String::as_str), Some("6"));
    let e = load_str("", &[("OUTBOX_KAFKA__PROPERTIES__SASL_PASSWORD", "s3cret")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("OUTBOX_KAFKA__PROPERTIES__SASL__PASSWORD") && e.contains("\"sasl.password\""),
        "{e}"
    );
    assert!(!e.contains("s3cret"), "{e}");
}
