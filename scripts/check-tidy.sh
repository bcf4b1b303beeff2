#!/usr/bin/env bash
# Every module's go.mod and go.sum are what `go mod tidy` makes of them, so a
# dependency added to one module cannot hide in another's files.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
for m in $(sed -n 's/^[[:space:]]*\(\.[^[:space:]]*\)$/\1/p' go.work); do
  if ! (cd "$m" && GOWORK=off GOFLAGS=-mod=mod go mod tidy -diff >/dev/null 2>&1); then
    echo "go.mod/go.sum of $m are not tidy: run (cd $m && GOWORK=off go mod tidy)"
    (cd "$m" && GOWORK=off GOFLAGS=-mod=mod go mod tidy -diff 2>&1 | head -40) || true
    fail=1
  fi
done
exit "$fail"
