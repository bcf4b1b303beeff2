#!/usr/bin/env bash
# Prints the path of a `go build -overlay` file that adds pgx's database/sql
# driver ("pgx") to internal/testkit/testdb, for running the core's suites on pgx
# (OUTBOX_TEST_DRIVER=pgx). The core's go.mod does not require pgx, so that a
# service importing the core never gets it through us; in the workspace
# (go.work) pgx resolves through the modules that do require it (pgxadapter,
# cdcrelay).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${TMPDIR:-/tmp}/outbox-pgx-overlay"
mkdir -p "$dir"
cat >"$dir/pgx_driver.go" <<'GO'
package testdb

import _ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
GO
printf '{"Replace":{"%s/internal/testkit/testdb/zz_pgx_driver.go":"%s/pgx_driver.go"}}\n' "$repo" "$dir" >"$dir/overlay.json"
echo "$dir/overlay.json"
