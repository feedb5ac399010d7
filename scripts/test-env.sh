#!/usr/bin/env bash
# Ensures the servers the test suite needs are running on loopback, idempotently:
# PostgreSQL (started if down; database created if missing). Safe to run any number of times.
# Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test).
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
    psql -h 127.0.0.1 -U postgres -d test -q -tAc \
      "DO \$\$ DECLARE s text; BEGIN FOR s IN SELECT nspname FROM pg_namespace WHERE nspname LIKE 'outbox\_t\_%' LOOP EXECUTE format('DROP SCHEMA %I CASCADE', s); END LOOP; END \$\$;" >/dev/null
  fi
}

ensure_postgres
log "ready"
