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
        // Exactly that environment and the image's file, as the container has them.
        let work = workdir();
        std::fs::write(work.join("outbox.toml"), &image_toml).unwrap();
        let mut c = Command::new(bin());
        c.arg("config").current_dir(&work).env_clear();
        c.envs(env.iter().map(|(k, v)| (k, v)));
        let shown = check(c, &format!("outbox config with the environment of {name}"));
        let config: toml::Table = toml::from_str(&shown).unwrap();
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
