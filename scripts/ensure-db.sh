#!/usr/bin/env bash
# Make sure a PostgreSQL for the tests and the demo answers, and print its URL
# on stdout (everything else goes to stderr). In order:
#   1. OUTBOX_TEST_DATABASE_URL, when set, is used as it is;
#   2. 127.0.0.1:5432, when it answers;
#   3. the machine's own cluster, started with pg_ctlcluster (Debian);
#   4. a throwaway cluster in ./.pgdata (initdb + pg_ctl, port 55432),
#      installing Debian's postgresql first when it is missing and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "ensure-db: $*" >&2; }
answers() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
wait_for() {
  for _ in $(seq 1 60); do answers "$1" "$2" && return 0; sleep 0.5; done
  return 1
}

if [[ -n "${OUTBOX_TEST_DATABASE_URL:-}" ]]; then
  echo "$OUTBOX_TEST_DATABASE_URL"; exit 0
fi

DEFAULT_URL="postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
if answers 127.0.0.1 5432; then echo "$DEFAULT_URL"; exit 0; fi

if command -v pg_ctlcluster >/dev/null 2>&1 && [[ -d /etc/postgresql ]] && [[ -n "$(ls /etc/postgresql 2>/dev/null)" ]]; then
  ver="$(ls /etc/postgresql | sort -V | tail -1)"
  log "starting the local cluster $ver/main with pg_ctlcluster"
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start >&2 || true
  if wait_for 127.0.0.1 5432; then
    # The Debian cluster may not have the test database yet.
    if command -v psql >/dev/null 2>&1; then
      su postgres -c "psql -p 5432 -tAc \"SELECT 1 FROM pg_database WHERE datname='test'\"" 2>/dev/null | grep -q 1 \
        || su postgres -c "createdb -p 5432 test" >&2 || true
    fi
    echo "$DEFAULT_URL"; exit 0
  fi
  log "pg_ctlcluster did not bring up 127.0.0.1:5432"
fi

find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
BIN="$(find_bin || true)"
if [[ -z "$BIN" ]]; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "PostgreSQL is not installed: installing Debian's postgresql"
    DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql >&2 || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql >&2; }
    BIN="$(find_bin || true)"
  fi
fi
if [[ -z "$BIN" ]]; then
  log "no PostgreSQL answers at 127.0.0.1:5432, none is installed, and it cannot be installed here (need root and apt-get)."
  log "Set OUTBOX_TEST_DATABASE_URL to a reachable server, e.g. postgres://user@host:5432/db?sslmode=disable"
  exit 1
fi

PORT=55432
DATA="$PWD/.pgdata"
URL="postgres://postgres@127.0.0.1:$PORT/test?sslmode=disable"
if answers 127.0.0.1 "$PORT"; then echo "$URL"; exit 0; fi
RUNAS=()
if [[ "$(id -u)" == 0 ]]; then RUNAS=(su postgres -s /bin/bash -c); id postgres >/dev/null 2>&1 || useradd -r postgres; fi
run() { if [[ ${#RUNAS[@]} -gt 0 ]]; then "${RUNAS[@]}" "$*"; else bash -c "$*"; fi; }
if [[ ! -f "$DATA/PG_VERSION" ]]; then
  log "creating a throwaway cluster in $DATA"
  mkdir -p "$DATA"; [[ ${#RUNAS[@]} -gt 0 ]] && chown postgres "$DATA"
  run "$BIN/initdb -D '$DATA' -U postgres --auth=trust" >&2
fi
log "starting the throwaway cluster on port $PORT"
run "$BIN/pg_ctl -D '$DATA' -o '-p $PORT -k /tmp -c listen_addresses=127.0.0.1' -l '$DATA/log' -w start" >&2
run "$BIN/psql -h 127.0.0.1 -p $PORT -U postgres -tAc \"SELECT 1 FROM pg_database WHERE datname='test'\"" | grep -q 1 \
  || run "$BIN/createdb -h 127.0.0.1 -p $PORT -U postgres test" >&2
echo "$URL"
