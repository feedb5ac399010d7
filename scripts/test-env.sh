#!/usr/bin/env bash
# Ensures the servers the test suite needs are running on loopback, idempotently:
# PostgreSQL (started if down; database created if missing) and RabbitMQ (started if down).
# Safe to run any number of times.
# Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test),
#              AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f; another broker is used as is).
set -euo pipefail

DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
log() { printf '[test-env] %s\n' "$*"; }

pg_ready() { pg_isready -q -h 127.0.0.1 -p 5432 >/dev/null 2>&1; }

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
  # The default database 'test' is created when missing (only for the default local URL).
  if [ "$DATABASE_URL" = "postgres://postgres@127.0.0.1:5432/test" ]; then
    if ! psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1; then
      log "creating database test"
      psql -h 127.0.0.1 -U postgres -d postgres -c "CREATE DATABASE test" >/dev/null
    fi
    # Schemas left by earlier test runs.
    PGOPTIONS="-c client_min_messages=warning" psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "DO \$\$ DECLARE s text; BEGIN FOR s IN SELECT nspname FROM pg_namespace WHERE nspname LIKE 'outbox\_t\_%' LOOP EXECUTE format('DROP SCHEMA %I CASCADE', s); END LOOP; END \$\$;" >/dev/null
  fi
}

port_open() { (exec 3<>"/dev/tcp/$1/$2") >/dev/null 2>&1; }

ensure_rabbitmq() {
  if [ -n "${AMQP_URL:-}" ]; then
    log "using the broker at AMQP_URL"
    return
  fi
  if port_open 127.0.0.1 5672; then
    log "RabbitMQ is running on 127.0.0.1:5672"
    return
  fi
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    log "RabbitMQ is not running and rabbitmq-server is not installed: install it (apt-get install rabbitmq-server) or set AMQP_URL"
    exit 1
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

ensure_postgres
ensure_rabbitmq
log "ready"
