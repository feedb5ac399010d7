//! The shipped Kubernetes manifests as a kubelet runs them: each container of the Deployment gets
//! the environment Kubernetes gives it (every Service's link variables, the `kubernetes` Service's,
//! the Secret's keys through `envFrom`, the pod's host name) and the ConfigMap's file where the
//! volume mounts it, and runs its command with exactly that: `migrate` (the init container), then
//! `config`, the relay, and `healthcheck` against it.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use txoutbox_postgres::testing::{database_url, fresh_table, pool};

fn kubernetes() -> PathBuf {
    deploy().join("kubernetes")
}

/// A Service as its link variables name it: its name, cluster IP and ports (name, port, protocol).
struct Service {
    name: String,
    ip: &'static str,
    ports: Vec<(Option<String>, u16, String)>,
}

impl Service {
    fn from_manifest(doc: &serde_yaml::Value, ip: &'static str) -> Service {
        Service {
            name: doc["metadata"]["name"].as_str().unwrap().to_string(),
            ip,
            ports: doc["spec"]["ports"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p["name"].as_str().map(str::to_string),
                        p["port"].as_u64().unwrap() as u16,
                        p["protocol"].as_str().unwrap_or("TCP").to_string(),
                    )
                })
                .collect(),
        }
    }

    /// The variables the kubelet sets for this Service in every container of its namespace
    /// (Kubernetes documentation, "Services: Environment variables"; the Docker-links form).
    fn link_variables(&self) -> Vec<(String, String)> {
        let s = self.name.to_ascii_uppercase().replace('-', "_");
        let mut vars = Vec::new();
        let (_, first, first_proto) = &self.ports[0];
        vars.push((format!("{s}_SERVICE_HOST"), self.ip.to_string()));
        vars.push((format!("{s}_SERVICE_PORT"), first.to_string()));
        vars.push((
            format!("{s}_PORT"),
            format!("{}://{}:{first}", first_proto.to_ascii_lowercase(), self.ip),
        ));
        for (name, port, proto) in &self.ports {
            if let Some(name) = name {
                let n = name.to_ascii_uppercase().replace('-', "_");
                vars.push((format!("{s}_SERVICE_PORT_{n}"), port.to_string()));
            }
            let (lower, upper) = (proto.to_ascii_lowercase(), proto.to_ascii_uppercase());
            let base = format!("{s}_PORT_{port}_{upper}");
            vars.push((base.clone(), format!("{lower}://{}:{port}", self.ip)));
            vars.push((format!("{base}_PROTO"), lower));
            vars.push((format!("{base}_PORT"), port.to_string()));
            vars.push((format!("{base}_ADDR"), self.ip.to_string()));
        }
        vars
    }
}

/// The environment of a container of the Deployment: what the kubelet sets (the pod's host name,
/// the `kubernetes` Service's variables, and, with service links on, every Service's of the
/// namespace: the shipped one and two a namespace running this relay commonly has), then the
/// Secret's keys (`envFrom`), here with the values a user of this machine's servers would put there.
fn container_env(
    pod: &serde_yaml::Value,
    container: &serde_yaml::Value,
    secret: &[(String, String)],
) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "PATH".to_string(),
            std::env::var("PATH").unwrap_or_default(),
        ),
        (
            "HOSTNAME".to_string(),
            "outbox-relay-6d8f9c7b5-x2x7k".to_string(),
        ),
    ];
    let shipped = yaml(&kubernetes().join("service.yaml"));
    let mut services = vec![Service {
        name: "kubernetes".into(),
        ip: "10.96.0.1",
        ports: vec![(Some("https".into()), 443, "TCP".into())],
    }];
    // Service links: on by default; the shipped Deployment turns them off, and the binary must not
    // depend on that (a namespace's policy, or an older copy of the manifest, can turn them on).
    assert_eq!(
        pod["enableServiceLinks"].as_bool(),
        Some(false),
        "the Deployment sets enableServiceLinks: false"
    );
    services.push(Service::from_manifest(&shipped, "10.96.12.34"));
    services.push(Service {
        name: "outbox".into(),
        ip: "10.96.40.2",
        ports: vec![(Some("http".into()), 8080, "TCP".into())],
    });
    services.push(Service {
        name: "outbox-postgres".into(),
        ip: "10.96.40.3",
        ports: vec![(Some("postgres".into()), 5432, "TCP".into())],
    });
    for s in &services {
        env.extend(s.link_variables());
    }
    // envFrom: the Secret the container names, every key as a variable.
    let from: Vec<&str> = container["envFrom"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| e["secretRef"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(from, ["outbox-relay"]);
    env.extend(secret.iter().cloned());
    env
}

/// The arguments of `container`, the ConfigMap's file at the path its volume mount gives (here
/// under `root`).
fn args(container: &serde_yaml::Value, root: &Path) -> Vec<String> {
    let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap();
    container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| {
            let a = a.as_str().unwrap();
            match a.strip_prefix(mount) {
                Some(rest) => root
                    .join(rest.trim_start_matches('/'))
                    .display()
                    .to_string(),
                None => a.to_string(),
            }
        })
        .collect()
}

/// The binary with `args`, and `env` as its whole environment.
fn command(args: &[String], env: &[(String, String)], root: &Path) -> Command {
    let mut c = Command::new(bin());
    c.args(args)
        .env_clear()
        .envs(env.iter().cloned())
        .current_dir(root);
    c
}

/// `args` with its last argument (the container's command) replaced by `cmd`.
fn instead(args: &[String], cmd: &str) -> Vec<String> {
    let mut a = args.to_vec();
    a.pop();
    a.push(cmd.to_string());
    a
}

/// With the link variables of the namespace's Services (`OUTBOX_RELAY_PORT=tcp://...` among them),
/// the init container migrates, `outbox config` loads, the relay starts and `outbox healthcheck`
/// finds it healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_container_runs_with_the_environment_kubernetes_gives_it() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let port = free_port();
    let root = workdir();
    let configmap = yaml(&kubernetes().join("configmap.yaml"));
    for (file, content) in configmap["data"].as_mapping().unwrap() {
        std::fs::write(root.join(file.as_str().unwrap()), content.as_str().unwrap()).unwrap();
    }
    // The Secret as a user of these servers fills it: the database, its schema, the broker; and the
    // listen address on loopback, so that parallel tests do not share a port.
    let example = yaml(&kubernetes().join("example/secret.yaml"));
    let keys: Vec<&str> = example["stringData"]
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(keys, ["DATABASE_URL"]);
    let secret = vec![
        ("DATABASE_URL".to_string(), database_url()),
        (
            "OUTBOX_DATABASE__SCHEMA".to_string(),
            table.schema().to_string(),
        ),
        (
            "OUTBOX_KAFKA__BROKERS".to_string(),
            txoutbox_kafka::testing::brokers(),
        ),
        (
            "OUTBOX_HTTP__LISTEN".to_string(),
            format!("127.0.0.1:{port}"),
        ),
    ];
    let deployment = yaml(&kubernetes().join("deployment.yaml"));
    let pod = &deployment["spec"]["template"]["spec"];
    let init = &pod["initContainers"][0];
    let relay = &pod["containers"][0];

    let init_env = container_env(pod, init, &secret);
    let links: BTreeMap<&str, &str> = init_env
        .iter()
        .filter(|(k, _)| k.starts_with("OUTBOX_RELAY_"))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert!(links.contains_key("OUTBOX_RELAY_PORT"), "{links:?}");
    let out = run(command(&args(init, &root), &init_env, &root));
    assert!(
        out.status.success(),
        "the init container (migrate) failed with the kubelet's environment {links:?}:\n{}",
        text(&out.stderr)
    );

    let env = container_env(pod, relay, &secret);
    let relay_args = args(relay, &root);
    let out = run(command(&instead(&relay_args, "config"), &env, &root));
    assert!(
        out.status.success(),
        "outbox config failed with the kubelet's environment:\n{}",
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains(&format!("listen = \"127.0.0.1:{port}\"")),
        "{}",
        text(&out.stdout)
    );

    let mut started = Running::start(command(&relay_args, &env, &root));
    started.wait_log("serving /metrics", Duration::from_secs(60));
    let out = run(command(&instead(&relay_args, "healthcheck"), &env, &root));
    assert!(
        out.status.success(),
        "outbox healthcheck in the relay's container:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    started.signal("-TERM");
    assert_eq!(started.wait_exit(Duration::from_secs(60)), 0);
}
