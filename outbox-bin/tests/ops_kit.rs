//! The operations kit of `deploy/` against the real tools and a running relay: the alert rules pass
//! promtool's checks and unit tests; every PromQL expression of the rules, their tests and the Grafana
//! dashboard names only metrics and labels a running relay really exports (scraped here after making
//! it export every series); the Kubernetes manifests validate against the Kubernetes schemas
//! (kubernetes-validate) and agree with the image and the configuration; the Dockerfile, read by the
//! official parser, builds what the tests build and ships what the binary links.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use txoutbox_amqp::testing::Fixture;
use txoutbox_postgres::testing::{fresh_table, pool};

fn promtool() -> PathBuf {
    tool("promtool", "PROMTOOL")
}

fn rules_file() -> PathBuf {
    deploy().join("prometheus/outbox-alerts.yml")
}

fn dashboard() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana/outbox-dashboard.json")).unwrap(),
    )
    .unwrap()
}

/// Every `expr` of the rule file, with the rule's name and its annotations.
fn rule_exprs() -> Vec<(String, String, Vec<String>)> {
    let rules = yaml(&rules_file());
    let mut out = Vec::new();
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let name = rule["alert"]
                .as_str()
                .or(rule["record"].as_str())
                .unwrap()
                .to_string();
            let annotations = rule["annotations"]
                .as_mapping()
                .map(|m| {
                    m.values()
                        .map(|v| v.as_str().unwrap().to_string())
                        .collect()
                })
                .unwrap_or_default();
            out.push((
                name,
                rule["expr"].as_str().unwrap().to_string(),
                annotations,
            ));
        }
    }
    out
}

/// Every PromQL expression of the dashboard (panel targets and template queries), with the legend
/// of each target.
fn dashboard_exprs() -> Vec<(String, String, Option<String>)> {
    let d = dashboard();
    let mut out = Vec::new();
    for panel in d["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            out.push((
                panel["title"].as_str().unwrap().to_string(),
                target["expr"].as_str().unwrap().to_string(),
                target["legendFormat"].as_str().map(str::to_string),
            ));
        }
    }
    for var in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["query"]["query"].as_str() {
            // label_values(metric, label) names a metric and a label.
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|r| r.strip_suffix(')'))
                .unwrap();
            let (metric, label) = inner.split_once(',').unwrap();
            out.push((
                format!("variable {}", var["name"]),
                format!("count by ({}) ({})", label.trim(), metric.trim()),
                None,
            ));
        }
    }
    out
}

/// A dashboard expression with Grafana's variables replaced, for promtool.
fn as_promql(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__range", "1h")
        .replace("$job", ".*")
}

/// PromQL's operators and keywords that are words (functions are recognised by their `(`).
const PROMQL_WORDS: [&str; 23] = [
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "on",
    "without",
    "ignoring",
    "group_left",
    "group_right",
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
];

/// What an expression names: metrics, and label names (in selectors and groupings).
#[derive(Debug, Default)]
struct Names {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
}

fn names(expr: &str) -> Names {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Names::default();
    let (mut i, mut braces) = (0, 0);
    let mut label_list = false;
    let mut pending_grouping = false;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i += 1;
            while i < chars.len() && chars[i] != c {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            continue;
        }
        // A number or a duration (`0.95`, `1e3`, `5m` in a range): not a name.
        if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' || c == ':' || c == '$' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':' | '$'))
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            if word.starts_with('$') {
                continue;
            }
            let next = chars[i..].iter().find(|c| !c.is_whitespace()).copied();
            if braces > 0 || label_list {
                if braces == 0 || matches!(next, Some('=' | '!' | '~')) {
                    names.labels.insert(word);
                }
            } else if matches!(
                word.as_str(),
                "by" | "on" | "without" | "ignoring" | "group_left" | "group_right"
            ) {
                pending_grouping = true;
            } else if next != Some('(') && !PROMQL_WORDS.contains(&word.as_str()) {
                // Not a function call, an operator or a keyword: a metric (so a misspelt one is
                // caught, whatever its prefix).
                names.metrics.insert(word);
            }
            continue;
        }
        match c {
            '{' => braces += 1,
            '}' => braces -= 1,
            '(' if pending_grouping => {
                label_list = true;
                pending_grouping = false;
            }
            ')' if label_list => label_list = false,
            c if !c.is_whitespace() => pending_grouping = false,
            _ => {}
        }
        i += 1;
    }
    names
}

/// Label names a template reads: `{{ $labels.x }}` in annotations, `{{x}}` in legends.
fn template_labels(template: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for part in template.split("{{").skip(1) {
        let inner = part.split("}}").next().unwrap_or("").trim();
        if let Some(label) = inner.strip_prefix("$labels.") {
            out.insert(label.to_string());
        } else if inner.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !inner.is_empty()
        {
            out.insert(inner.to_string());
        }
    }
    out
}

/// A scrape: each sample name with the label names it carries.
fn samples(metrics: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in metrics
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, labels) = match line.split_once('{') {
            Some((name, rest)) => (name, rest.rsplit_once('}').unwrap().0),
            None => (line.split_whitespace().next().unwrap(), ""),
        };
        let entry = out.entry(name.to_string()).or_default();
        for pair in split_labels(labels) {
            entry.insert(pair.split_once('=').unwrap().0.to_string());
        }
    }
    out
}

/// `a="x",b="y,z"` into its pairs (commas inside values kept).
fn split_labels(labels: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted, mut escaped) = (Vec::new(), String::new(), false, false);
    for c in labels.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Labels Prometheus adds to every scraped series (and `up`, the series it makes itself).
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

#[test]
fn alert_rules_pass_promtool_checks_and_unit_tests() {
    let dir = deploy().join("prometheus");
    let mut c = Command::new(promtool());
    c.args(["check", "rules", "outbox-alerts.yml"])
        .current_dir(&dir);
    let out = check(c, "promtool check rules");
    assert!(out.contains("SUCCESS: 19 rules found"), "{out}");
    let mut c = Command::new(promtool());
    c.args(["test", "rules", "outbox-alerts.test.yml"])
        .current_dir(&dir);
    let out = check(c, "promtool test rules");
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert has a unit test that expects it to fire.
    let tests = std::fs::read_to_string(dir.join("outbox-alerts.test.yml")).unwrap();
    for (alert, _, _) in rule_exprs() {
        let fires = tests
            .split("alertname: ")
            .skip(1)
            .filter(|case| case.starts_with(&format!("{alert}\n")))
            .any(|case| case.contains("exp_labels"));
        assert!(fires, "no test of {alert} expects it to fire");
    }
}

#[test]
fn dashboard_expressions_are_valid_promql() {
    // promtool parses every expression as a recording rule.
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 25, "{} expressions", exprs.len());
    for (i, (_, expr, _)) in exprs.iter().enumerate() {
        file += &format!(
            "      - record: dashboard:expr_{i}\n        expr: {}\n",
            serde_json::to_string(&as_promql(expr)).unwrap()
        );
    }
    let dir = workdir();
    std::fs::write(dir.join("dashboard-rules.yml"), file).unwrap();
    let mut c = Command::new(promtool());
    c.args(["check", "rules", "dashboard-rules.yml"])
        .current_dir(&dir);
    let out = check(c, "promtool check rules (the dashboard's expressions)");
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{out}"
    );
    // The panels the issue of operators asks for are there.
    let titles: Vec<String> = dashboard()["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap().to_lowercase())
        .collect();
    for wanted in [
        "throughput",
        "pending",
        "oldest pending",
        "batch duration",
        "failures by event type",
        "dead letters",
        "held back",
    ] {
        assert!(
            titles.iter().any(|t| t.contains(wanted)),
            "no panel about {wanted}: {titles:?}"
        );
    }
}

#[test]
fn the_expression_reader_finds_metrics_and_labels() {
    let n = names(
        r#"histogram_quantile(0.95, sum by (job, le) (rate(outbox_batch_duration_seconds_bucket{job=~"$job",x!="a,b"}[5m]))) > 5 and on (job) up == 0"#,
    );
    assert_eq!(
        n.metrics,
        BTreeSet::from(["outbox_batch_duration_seconds_bucket".into(), "up".into()])
    );
    // A misspelt metric is a metric too (and then one no relay exports).
    let typo = names("sum(rate(outbx_events_published_total[5m])) > 0 unless on(job) vector(0)");
    assert_eq!(
        typo.metrics,
        BTreeSet::from(["outbx_events_published_total".into()])
    );
    assert_eq!(
        n.labels,
        BTreeSet::from(["job".into(), "le".into(), "x".into()])
    );
    assert_eq!(
        template_labels("{{ $labels.instance }} and {{event_type}} {{ $value | humanize }}"),
        BTreeSet::from(["instance".into(), "event_type".into()])
    );
}

/// What exports the metrics judged: the `outbox` binary's relay, or the example service that runs
/// its relay through the library (`examples/order_service_with_relay.rs`).
#[derive(Debug, Clone, Copy)]
enum Exporter {
    Binary,
    ComposedRelay,
}

/// The example service's executable, built next to this test by `cargo test`.
fn example_service() -> std::path::PathBuf {
    let path = std::path::Path::new(bin())
        .parent()
        .unwrap()
        .join("examples")
        .join("order_service_with_relay");
    assert!(
        path.exists(),
        "the example is not built at {}: run `cargo test --workspace --all-features` (it builds the examples)",
        path.display()
    );
    path
}

/// Starts a relay that exports every series it has (a published event, a failed and dead-lettered
/// one with an event held back behind it, pending events by type, a failed claim, cleanup rounds)
/// and returns its `/metrics`.
async fn scrape_of_a_relay_exporting_everything(exporter: Exporter) -> String {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let fx = Fixture::new().await;
    let port = free_port();
    let relay = match exporter {
        Exporter::Binary => {
            let mut c = outbox(&table, &["relay"]);
            c.env("OUTBOX_PUBLISHER__TYPE", "amqp")
                .env("OUTBOX_AMQP__URL", txoutbox_amqp::testing::amqp_url())
                .env("OUTBOX_AMQP__EXCHANGE", &fx.exchange)
                .env("OUTBOX_HTTP__ENABLED", "true")
                .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"))
                .env("OUTBOX_HTTP__STATS_INTERVAL", "200ms")
                .env("OUTBOX_DATABASE__KEEP_PROCESSED_FOR", "1s")
                .env("OUTBOX_DATABASE__CLEANUP_INTERVAL", "1s")
                .env("OUTBOX_RELAY__POLL_INTERVAL", "100ms");
            let relay = Running::start(c);
            relay.wait_log("serving /metrics", Duration::from_secs(30));
            relay
        }
        Exporter::ComposedRelay => {
            assert_eq!(table.table(), "outbox_events", "the example's table");
            let mut c = std::process::Command::new(example_service());
            c.env("DATABASE_URL", txoutbox_postgres::testing::database_url())
                .env("AMQP_URL", txoutbox_amqp::testing::amqp_url())
                .env("AMQP_EXCHANGE", &fx.exchange)
                .env("LISTEN", format!("127.0.0.1:{port}"))
                .env("OUTBOX_SCHEMA", table.schema())
                .env("KEEP_PROCESSED_FOR_SECS", "1");
            let relay = Running::start(c);
            relay.wait_output("listening on", Duration::from_secs(30));
            relay
        }
    };
    // One event published; then, on aggregate o-2, one the allow-list refuses (dead-lettered) and
    // one held back behind it.
    insert_plain(&table, "o-1", 1).await;
    fx.wait_for(1, Duration::from_secs(30)).await;
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, destination) VALUES ('order', 'o-2', 'order.refused', '{{}}', 'not.allowed')",
        table.qualified()
    ))
    .execute(&pg)
    .await
    .unwrap();
    insert_plain(&table, "o-2", 1).await;
    let get = move || tokio::task::spawn_blocking(move || http_get(port, "/metrics").1);
    let wait = |what: &'static str, done: fn(&str) -> bool| async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let m = get().await.unwrap();
            if done(&m) {
                return m;
            }
            assert!(Instant::now() < deadline, "{what}:\n{m}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    wait("a dead letter holding an event back", |m| {
        metric(m, "outbox_events_held_back") == 1.0
            && metric(m, "outbox_events_published_total") == 1.0
            && m.contains("outbox_cleanup_runs_total{outcome=\"done\"}")
    })
    .await;
    // A claim that fails: the table is away for a moment.
    let t = table.qualified();
    sqlx::query(&format!("ALTER TABLE {t} RENAME TO away"))
        .execute(&pg)
        .await
        .unwrap();
    wait("a failed claim", |m| {
        m.contains("outbox_store_errors_total{operation=\"claim\"}")
    })
    .await;
    sqlx::query(&format!(
        "ALTER TABLE {}.away RENAME TO {}",
        table.schema(),
        table.table()
    ))
    .execute(&pg)
    .await
    .unwrap();
    // The statistics refresh that ran while the table was away failed; the scrape judged is one
    // taken after a refresh has succeeded again (the per-type family has its sample back).
    let m = wait("a statistics refresh with the table back", |m| {
        m.contains("outbox_events_pending_by_type{") && metric(m, "outbox_events_held_back") == 1.0
    })
    .await;
    drop(relay);
    fx.cleanup().await;
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_and_dashboard_name_only_what_a_running_relay_exports() {
    judge_rules_and_dashboard(Exporter::Binary).await;
}

/// A relay composed in a service from the library exports what the alert rules and the dashboard
/// read, as the binary does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_and_dashboard_name_only_what_a_composed_relay_exports() {
    judge_rules_and_dashboard(Exporter::ComposedRelay).await;
}

async fn judge_rules_and_dashboard(exporter: Exporter) {
    let scrape = scrape_of_a_relay_exporting_everything(exporter).await;
    let exported = samples(&scrape);
    // Every family the relay registers has samples in this scrape (so none is judged on HELP alone).
    for line in scrape.lines().filter(|l| l.starts_with("# TYPE ")) {
        let family = line.split_whitespace().nth(2).unwrap();
        assert!(
            exported.keys().any(|s| s.starts_with(family)),
            "no sample of {family} in the scrape:\n{scrape}"
        );
    }
    let mut problems = Vec::new();
    let mut judge = |origin: String, expr: &str, templates: Vec<String>| {
        let n = names(expr);
        if n.metrics.is_empty() {
            problems.push(format!("{origin}: names no metric: {expr}"));
        }
        let mut known: BTreeSet<String> = TARGET_LABELS.iter().map(|s| s.to_string()).collect();
        for m in &n.metrics {
            match exported.get(m) {
                Some(labels) => known.extend(labels.iter().cloned()),
                None if m == "up" => {}
                None => problems.push(format!("{origin}: {m} is not exported")),
            }
        }
        let used = n
            .labels
            .iter()
            .cloned()
            .chain(templates.iter().flat_map(|t| template_labels(t)));
        for label in used {
            if !known.contains(&label) {
                problems.push(format!(
                    "{origin}: label {label} is on none of {:?}",
                    n.metrics
                ));
            }
        }
    };
    for (alert, expr, annotations) in rule_exprs() {
        judge(format!("alert {alert}"), &expr, annotations);
    }
    for (panel, expr, legend) in dashboard_exprs() {
        judge(
            format!("panel {panel}"),
            &as_promql(&expr),
            legend.into_iter().collect(),
        );
    }
    // The unit tests' input series are shaped like the scrape.
    let tests = yaml(&deploy().join("prometheus/outbox-alerts.test.yml"));
    for case in tests["tests"].as_sequence().unwrap() {
        for series in case["input_series"].as_sequence().unwrap() {
            let s = series["series"].as_str().unwrap();
            judge(format!("test series {s}"), s, vec![]);
        }
    }
    assert!(problems.is_empty(), "{problems:#?}\nscrape:\n{scrape}");
}

#[test]
fn kubernetes_manifests_validate_and_agree_with_the_image_and_configuration() {
    let dir = deploy().join("kubernetes");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".yaml"))
        .collect();
    files.sort();
    // What `kubectl apply -f kubernetes/` applies: no Secret among them (the example is one level
    // down, out of its reach).
    assert_eq!(
        files,
        [
            "configmap.yaml",
            "deployment.yaml",
            "poddisruptionbudget.yaml",
            "service.yaml"
        ]
    );
    files.push("example/secret.yaml".into());
    // The oldest Kubernetes still commonly run, and the checker's newest.
    for version in ["1.29.0", "1.37.0"] {
        let mut c = Command::new(tool("kubernetes-validate", "KUBERNETES_VALIDATE"));
        c.args(["--strict", "-k", version])
            .args(&files)
            .current_dir(&dir);
        let out = check(c, &format!("kubernetes-validate {version}"));
        assert_eq!(out.matches("passed").count(), files.len(), "{out}");
    }
    // The configuration file of the ConfigMap loads, as the relay would read it, with the Secret's
    // variables.
    let config = yaml(&dir.join("configmap.yaml"));
    let toml = config["data"]["outbox.toml"].as_str().unwrap();
    let work = workdir();
    std::fs::write(work.join("outbox.toml"), toml).unwrap();
    let secret = yaml(&dir.join("example/secret.yaml"));
    let mut c = Command::new(bin());
    c.args(["--config", "outbox.toml", "config"])
        .current_dir(&work);
    for (k, v) in secret["stringData"].as_mapping().unwrap() {
        c.env(k.as_str().unwrap(), v.as_str().unwrap());
    }
    let shown = check(c, "outbox config (the ConfigMap's file)");
    assert!(
        shown.contains("postgres://outbox:***@postgres:5432/app"),
        "{shown}"
    );
    assert!(shown.contains("listen = \"0.0.0.0:9464\""), "{shown}");
    // The Deployment runs the image's binary with that file, probes the endpoints the relay serves
    // on the port it listens on, and runs as the image's user.
    let deployment = yaml(&dir.join("deployment.yaml"));
    let pod = &deployment["spec"]["template"]["spec"];
    let relay = &pod["containers"][0];
    let args: Vec<&str> = relay["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args, ["--config", "/etc/outbox/outbox.toml", "relay"]);
    assert_eq!(
        relay["volumeMounts"][0]["mountPath"].as_str(),
        Some("/etc/outbox")
    );
    assert_eq!(relay["ports"][0]["containerPort"].as_u64(), Some(9464));
    assert_eq!(
        relay["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        relay["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert!(
        relay["readinessProbe"]["timeoutSeconds"].as_u64().unwrap() > 2,
        "the probe waits longer than http.ready_timeout"
    );
    assert_eq!(pod["securityContext"]["runAsUser"].as_u64(), Some(10001));
    assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2);
    let migrate: Vec<&str> = pod["initContainers"][0]["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(migrate, ["--config", "/etc/outbox/outbox.toml", "migrate"]);
    let dockerfile = std::fs::read_to_string(deploy().join("Dockerfile")).unwrap();
    assert!(dockerfile.contains("EXPOSE 9464") && dockerfile.contains("USER 10001:10001"));
    // The image's own configuration loads too, and puts the endpoint where the probes look.
    let mut c = Command::new(bin());
    c.args(["--config"])
        .arg(deploy().join("outbox.toml"))
        .arg("config")
        .current_dir(&work);
    let shown = check(c, "outbox config (the image's file)");
    assert!(shown.contains("listen = \"0.0.0.0:9464\""), "{shown}");
    assert!(shown.contains("format = \"json\""), "{shown}");
}

/// The Dockerfile as the official parser reads it (PyPI `dockerfile`, the Go parser of BuildKit):
/// `(instruction, values)` in order.
fn dockerfile_instructions() -> Vec<(String, Vec<String>)> {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/ops-venv/bin/python");
    assert!(
        python.exists(),
        "the Dockerfile parser is not installed: run `bash scripts/test-env.sh`"
    );
    let mut c = Command::new(python);
    c.args([
        "-c",
        "import dockerfile, json, sys; print(json.dumps([[c.cmd, list(c.value)] for c in dockerfile.parse_file(sys.argv[1])]))",
    ])
    .arg(deploy().join("Dockerfile"));
    let out = check(c, "parsing the Dockerfile");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn the_dockerfile_builds_what_the_tests_build_and_ships_what_the_binary_links() {
    let all = dockerfile_instructions();
    let stages: Vec<usize> = all
        .iter()
        .enumerate()
        .filter(|(_, (cmd, _))| cmd == "FROM")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let (build, runtime) = all.split_at(stages[1]);
    let runs = |stage: &[(String, Vec<String>)]| -> String {
        stage
            .iter()
            .filter(|(cmd, _)| cmd == "RUN")
            .map(|(_, v)| v.join(" "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    // The build: this workspace's lock file, the binary's crate, the chosen adapters (by default
    // every adapter the binary's `full` feature has).
    let build_runs = runs(build);
    assert!(
        build_runs.contains("cargo build --release --locked -p txoutbox --no-default-features --features \"${FEATURES}\""),
        "{build_runs}"
    );
    let manifest =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .unwrap();
    let full: toml::Value = toml::from_str(&manifest).unwrap();
    let adapters: Vec<&str> = full["features"]["full"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let default_features = build
        .iter()
        .find(|(cmd, v)| cmd == "ARG" && v[0].starts_with("FEATURES="))
        .map(|(_, v)| v[0]["FEATURES=".len()..].to_string())
        .unwrap();
    assert_eq!(default_features, adapters.join(","));
    // The runtime: not root, a health check through the binary's own subcommand, the relay by
    // default.
    let find = |cmd: &str| {
        runtime
            .iter()
            .rev()
            .find(|(c, _)| c == cmd)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {cmd} in the runtime stage"))
    };
    let user = find("USER")[0].clone();
    assert!(
        !user.starts_with("0") && !user.starts_with("root"),
        "runs as {user}"
    );
    assert_eq!(find("HEALTHCHECK")[1..], ["outbox", "healthcheck"]);
    assert_eq!(find("WORKDIR"), ["/etc/outbox"]);
    assert!(
        runtime.iter().any(|(c, v)| c == "COPY"
            && v == &["outbox-bin/deploy/outbox.toml", "/etc/outbox/outbox.toml"]),
        "the image carries its configuration file where the relay and the health check read it"
    );
    assert!(
        runtime.iter().all(|(c, _)| c != "ENV"),
        "no ENV: it would override the mounted configuration file"
    );
    assert_eq!(find("ENTRYPOINT"), ["outbox"]);
    assert_eq!(find("CMD"), ["relay"]);
    let help = Command::new(bin())
        .args(["healthcheck", "--help"])
        .output()
        .unwrap();
    assert!(help.status.success(), "outbox healthcheck exists");
    // Every shared library the binary links comes with the base image or a package installed in the
    // runtime stage. The binary and the package names are this machine's: the check holds for the
    // image when this machine runs the runtime's Debian release, which it checks first.
    let base = runtime[0].1[0].clone();
    let release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let codename = release
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .unwrap_or("")
        .trim_matches('"')
        .to_string();
    if !base.starts_with(&format!("debian:{codename}")) {
        eprintln!(
            "the shared-library check of the Dockerfile compares the binary built here with the image's {base}: \
             it runs on a Debian host of that release only (this one is {codename:?}); the rest of the Dockerfile was checked"
        );
        return;
    }
    let runtime_runs = runs(runtime);
    let ldd = check(
        {
            let mut c = Command::new("ldd");
            c.arg(bin());
            c
        },
        "ldd",
    );
    for lib in ldd
        .lines()
        .filter_map(|l| l.split("=>").nth(1))
        .filter_map(|p| p.split_whitespace().next())
        .filter(|p| p.starts_with('/'))
    {
        let file = Path::new(lib).file_name().unwrap().to_string_lossy();
        let owner = check(
            {
                let mut c = Command::new("dpkg");
                c.args(["-S", &format!("*/{file}")]);
                c
            },
            "dpkg -S",
        );
        let package = owner.split(':').next().unwrap().trim().to_string();
        let in_base = ["libc6", "libgcc-s1"].contains(&package.as_str());
        assert!(
            in_base || runtime_runs.split_whitespace().any(|w| w == package),
            "{lib} (package {package}) is not installed in the runtime stage:\n{runtime_runs}"
        );
    }
}
