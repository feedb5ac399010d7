//! The Compose quick start (`deploy/compose.yaml`), without a container engine: it validates
//! against the Compose specification's JSON schema, and what it gives each container agrees with
//! the image and the binary. Every service the binary runs in gets the image built from
//! `deploy/Dockerfile` and runs `outbox config` with exactly its environment and the image's
//! configuration file; the addresses it configures name services of the file, on the ports they
//! listen on inside the network; the published metrics port is the one the image's file listens on.
//!
//! The schema (`tests/data/compose-spec.json`) is `schema/compose-spec.json` of
//! github.com/compose-spec/compose-spec at commit 170098ba07d9f53c383a41bfd4c5166b0a4529a6
//! (Apache-2.0).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use common::*;

fn compose() -> serde_yaml::Value {
    yaml(&deploy().join("compose.yaml"))
}

/// The Python of `scripts/test-env.sh`'s ops tools, which has `jsonschema`.
fn ops_python() -> PathBuf {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/ops-venv/bin/python");
    assert!(
        python.exists(),
        "the ops tools' Python (with jsonschema) is not installed: run `bash scripts/test-env.sh`"
    );
    python
}

/// Validates the JSON `instance` against the Compose specification's schema; the checker's
/// output lists each error.
fn validate(instance: &[u8]) -> std::process::Output {
    let schema = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/compose-spec.json");
    let mut child = Command::new(ops_python())
        .args([
            "-c",
            "import json, sys, jsonschema\n\
             schema = json.load(open(sys.argv[1]))\n\
             errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(json.load(sys.stdin)), key=str)\n\
             for e in errors: print(list(e.absolute_path), e.message)\n\
             sys.exit(1 if errors else 0)",
        ])
        .arg(&schema)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(instance).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn compose_file_validates_against_the_compose_specification() {
    let out = validate(&serde_json::to_vec(&compose()).unwrap());
    assert!(
        out.status.success(),
        "compose.yaml does not validate against the Compose specification:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    // And a file the schema refuses is refused (the check can fail).
    let out = validate(br#"{"services": {"relay": {"imag": "outbox:local"}}}"#);
    assert!(!out.status.success());
    assert!(text(&out.stdout).contains("imag"), "{}", text(&out.stdout));
}

/// A service's `ports` as (published, target) pairs.
fn ports(service: &serde_yaml::Value) -> Vec<(u16, u16)> {
    service["ports"]
        .as_sequence()
        .map(|ports| {
            ports
                .iter()
                .map(|p| {
                    let (published, target) = p.as_str().unwrap().split_once(':').unwrap();
                    (published.parse().unwrap(), target.parse().unwrap())
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The host and port of an address (`host:port`, or a URL with them).
fn host_port(address: &str) -> (String, u16) {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let authority = rest.split('/').next().unwrap();
    let (host, port) = authority.rsplit_once(':').unwrap();
    (host.to_string(), port.parse().unwrap())
}

/// What `outbox config` shows with exactly the environment of `service` and the image's
/// configuration file `image_toml`, as its container has them.
fn config_of(name: &str, service: &serde_yaml::Value, image_toml: &str) -> toml::Table {
    let env: Vec<(String, String)> = service["environment"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let value = match v {
                serde_yaml::Value::String(s) => s.clone(),
                other => serde_yaml::to_string(other).unwrap().trim().to_string(),
            };
            (k.as_str().unwrap().to_string(), value)
        })
        .collect();
    let work = workdir();
    std::fs::write(work.join("outbox.toml"), image_toml).unwrap();
    let mut c = Command::new(bin());
    c.arg("config").current_dir(&work).env_clear();
    c.envs(env.iter().map(|(k, v)| (k, v)));
    let shown = check(c, &format!("outbox config with the environment of {name}"));
    toml::from_str(&shown).unwrap()
}

#[test]
fn compose_services_agree_with_the_image_and_the_binary() {
    let doc = compose();
    let services = doc["services"].as_mapping().unwrap();
    let names: BTreeSet<&str> = services.keys().map(|k| k.as_str().unwrap()).collect();
    // Every dependency is a service of the file.
    for (name, service) in services {
        if let Some(deps) = service["depends_on"].as_mapping() {
            for dep in deps.keys() {
                assert!(
                    names.contains(dep.as_str().unwrap()),
                    "{name:?} depends on {dep:?}, which is not a service"
                );
            }
        }
    }
    // PostgreSQL as the WAL source needs it.
    let postgres = &doc["services"]["postgres"];
    let command: Vec<&str> = postgres["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(command.contains(&"wal_level=logical"), "{command:?}");

    // The image is built from the Dockerfile of the kit, from the repository's root.
    let migrate = &doc["services"]["migrate"];
    let root = deploy().join(migrate["build"]["context"].as_str().unwrap());
    assert!(
        root.join(migrate["build"]["dockerfile"].as_str().unwrap())
            .canonicalize()
            .unwrap()
            == deploy().join("Dockerfile").canonicalize().unwrap()
    );
    let image = migrate["image"].as_str().unwrap();
    // The image's working directory holds its configuration file (`COPY ... /etc/outbox/outbox.toml`,
    // `WORKDIR /etc/outbox`), which the binary reads as ./outbox.toml.
    let dockerfile = std::fs::read_to_string(deploy().join("Dockerfile")).unwrap();
    assert!(dockerfile.contains("COPY outbox-bin/deploy/outbox.toml /etc/outbox/outbox.toml"));
    assert!(dockerfile.contains("WORKDIR /etc/outbox"));
    assert!(dockerfile.contains("ENTRYPOINT [\"outbox\"]"));
    let image_toml = std::fs::read_to_string(deploy().join("outbox.toml")).unwrap();

    let mut runs = 0;
    for (name, service) in services {
        let name = name.as_str().unwrap();
        if service["image"].as_str() != Some(image) {
            continue;
        }
        runs += 1;
        let args: Vec<&str> = service["command"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(args == ["migrate"] || args == ["relay"], "{name}: {args:?}");
        let config = config_of(name, service, &image_toml);
        let section = |s: &str, k: &str| config[s][k].as_str().unwrap().to_string();
        // The database is the postgres service, on its port inside the network.
        let (host, port) = host_port(&section("database", "url"));
        assert_eq!(host, "postgres", "{name}");
        assert!(
            ports(postgres).iter().any(|(_, target)| *target == port),
            "{name}"
        );
        if args != ["relay"] {
            continue;
        }
        // The broker address names the broker's service, on a port it listens on; the relay
        // waits for that service.
        let publisher = section("publisher", "type");
        let (broker_host, broker_port) = match publisher.as_str() {
            "amqp" => host_port(&section("amqp", "url")),
            "kafka" => host_port(&section("kafka", "brokers")),
            "sqs" => host_port(&section("sqs", "endpoint_url")),
            other => panic!("{name}: publisher {other}"),
        };
        let broker = &doc["services"][broker_host.as_str()];
        assert!(broker.is_mapping(), "{name}: no service {broker_host}");
        let listens: Vec<u16> = match publisher.as_str() {
            // Kafka listens where its listener says (and advertises it under the service's name).
            "kafka" => {
                let advertised = broker["environment"]["KAFKA_ADVERTISED_LISTENERS"]
                    .as_str()
                    .unwrap();
                assert!(
                    advertised.contains(&format!("//{broker_host}:{broker_port}")),
                    "{advertised}"
                );
                vec![broker_port]
            }
            _ => ports(broker).iter().map(|(_, target)| *target).collect(),
        };
        assert!(
            listens.contains(&broker_port),
            "{name}: {broker_host} does not listen on {broker_port}"
        );
        let deps = service["depends_on"].as_mapping().unwrap();
        assert!(deps.contains_key("migrate"), "{name} waits for the table");
        let waits_for_broker = deps.keys().any(|d| {
            d.as_str() == Some(broker_host.as_str())
                || doc["services"][d.as_str().unwrap()]["depends_on"]
                    .as_mapping()
                    .is_some_and(|m| m.contains_key(broker_host.as_str()))
        });
        assert!(waits_for_broker, "{name} waits for {broker_host}");
        // The published port reaches the metrics endpoint the image's file listens on.
        let (_, listen_port) = host_port(&section("http", "listen"));
        assert!(
            ports(service)
                .iter()
                .any(|(_, target)| *target == listen_port),
            "{name}: metrics listen on {listen_port}"
        );
        assert!(
            section("http", "listen").starts_with("0.0.0.0:"),
            "{name}: reachable from outside the container"
        );
    }
    // migrate and a relay for each of the three brokers.
    assert_eq!(runs, 4);
}

/// The user and password of a URL (`scheme://user:password@host...`).
fn credentials(url: &str) -> (String, String) {
    let rest = url.split_once("://").unwrap().1;
    let (userinfo, _) = rest.rsplit_once('@').unwrap();
    let (user, password) = userinfo.split_once(':').unwrap();
    (user.to_string(), password.to_string())
}

/// The quick start shows what it promises. RabbitMQ loads definitions at boot that bind a demo
/// queue so that every event the relay publishes lands there: the relay's exchange and its type, a
/// `#` binding, and the user the relay logs in as, with that password and the permissions it uses.
/// The relay keeps mandatory routing. The header's insert runs through `docker compose exec` into
/// the table the relay reads, and says how to see the queue. The URL the header and the README
/// give for PostgreSQL reaches the postgres service with its password.
#[test]
fn the_demo_queue_takes_every_event_and_the_urls_agree() {
    use sha2::{Digest, Sha256};
    let doc = compose();
    let rabbitmq = &doc["services"]["rabbitmq"];
    let relay = &doc["services"]["relay"];
    let postgres = &doc["services"]["postgres"];

    // What RabbitMQ is given: a conf.d file naming the definitions it loads at boot.
    let volumes: Vec<(String, String)> = rabbitmq["volumes"]
        .as_sequence()
        .expect("rabbitmq mounts its demo definitions")
        .iter()
        .map(|v| {
            let parts: Vec<&str> = v.as_str().unwrap().split(':').collect();
            (parts[0].to_string(), parts[1].to_string())
        })
        .collect();
    let mounted = |target: &str| -> PathBuf {
        let (source, _) = volumes
            .iter()
            .find(|(_, t)| t == target)
            .unwrap_or_else(|| panic!("rabbitmq mounts nothing at {target}: {volumes:?}"));
        deploy().join(source)
    };
    let conf_at = volumes
        .iter()
        .find(|(_, t)| t.starts_with("/etc/rabbitmq/conf.d/") && t.ends_with(".conf"))
        .map(|(_, t)| t.clone())
        .expect("a file in RabbitMQ's conf.d");
    let conf = std::fs::read_to_string(mounted(&conf_at)).unwrap();
    let definitions_at = conf
        .lines()
        .find_map(|l| l.strip_prefix("load_definitions = "))
        .expect("the conf.d file loads definitions")
        .trim()
        .to_string();
    let definitions: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(mounted(&definitions_at)).unwrap()).unwrap();
    let named = |kind: &str, name: &str| -> serde_json::Value {
        definitions[kind]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} named {name} in {definitions_at}"))
            .clone()
    };

    // The relay's exchange, declared alike, and a queue bound to it with `#`.
    let image_toml = std::fs::read_to_string(deploy().join("outbox.toml")).unwrap();
    let config = config_of("relay", relay, &image_toml);
    let amqp = &config["amqp"];
    assert_eq!(
        amqp["mandatory"].as_bool(),
        Some(true),
        "the relay keeps mandatory routing"
    );
    let exchange_name = amqp["exchange"].as_str().unwrap();
    let exchange = named("exchanges", exchange_name);
    assert_eq!(exchange["type"], amqp["exchange_type"].as_str().unwrap());
    assert_eq!(exchange["durable"], true, "as the relay declares it");
    let binding = definitions["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| {
            b["source"] == exchange_name
                && b["destination_type"] == "queue"
                && b["routing_key"] == "#"
        })
        .expect("a queue bound to the relay's exchange with #");
    let queue = binding["destination"].as_str().unwrap();
    assert_eq!(named("queues", queue)["durable"], true);

    // The user the relay logs in as: that password (RabbitMQ's salted SHA-256), and permission to
    // declare and write to the exchange on the URL's virtual host.
    let url = relay["environment"]["OUTBOX_AMQP__URL"].as_str().unwrap();
    let (user, password) = credentials(url);
    let vhost = url.rsplit('/').next().unwrap().replace("%2f", "/");
    let stored = named("users", &user);
    assert_eq!(
        stored["hashing_algorithm"],
        "rabbit_password_hashing_sha256"
    );
    let hash = txoutbox_core::format::base64_decode(stored["password_hash"].as_str().unwrap())
        .expect("a base64 password hash");
    let (salt, digest) = hash.split_at(4);
    let computed = Sha256::digest([salt, password.as_bytes()].concat());
    assert_eq!(
        digest,
        computed.as_slice(),
        "the stored password is not the relay's"
    );
    let permission = definitions["permissions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["user"] == user.as_str() && p["vhost"] == vhost.as_str())
        .expect("the relay's user has permissions on its virtual host");
    for what in ["configure", "write"] {
        assert_eq!(permission[what], ".*", "{what}");
    }
    for kind in ["exchanges", "queues", "bindings"] {
        for d in definitions[kind].as_array().unwrap() {
            assert_eq!(d["vhost"], vhost.as_str(), "{kind}: {d}");
        }
    }

    // The header: the insert through `docker compose exec` into the relay's table, and how to see
    // the queue.
    let text = std::fs::read_to_string(deploy().join("compose.yaml")).unwrap();
    let header: String = text
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| format!("{}\n", l.trim_start_matches('#')))
        .collect();
    let table = config["database"]["table"].as_str().unwrap();
    assert!(
        header.contains("exec postgres psql") && header.contains(&format!("INSERT INTO {table} ")),
        "{header}"
    );
    assert!(
        header.contains("rabbitmqctl list_queues") && header.contains(queue),
        "{header}"
    );

    // The URL given for PostgreSQL from the host: the service's password, a published port that
    // reaches the server's, the image's default database (its user's name); the README gives it too.
    let given = header
        .split_whitespace()
        .find_map(|w| {
            w.strip_prefix("postgres://")
                .map(|r| format!("postgres://{r}"))
        })
        .map(|u| u.trim_end_matches([')', ',', ';']).to_string())
        .expect("the header gives PostgreSQL's URL");
    let (pg_user, pg_password) = credentials(&given);
    assert_eq!(
        postgres["environment"]["POSTGRES_PASSWORD"].as_str(),
        Some(pg_password.as_str())
    );
    assert!(postgres["environment"]["POSTGRES_USER"].is_null() && pg_user == "postgres");
    assert!(postgres["environment"]["POSTGRES_DB"].is_null() && given.ends_with("/postgres"));
    let (host, port) = host_port(&given);
    assert_eq!(host, "127.0.0.1");
    assert!(
        ports(postgres)
            .iter()
            .any(|(published, target)| *published == port && *target == 5432),
        "{given}"
    );
    let readme =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    assert!(readme.contains(&given), "the README gives {given}");
}
