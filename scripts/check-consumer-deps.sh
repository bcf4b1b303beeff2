#!/usr/bin/env bash
# The dependency target of the core module (issue 15): a service module
# outside this repository that imports publisher, forwarder and inbox, with a
# replace to this checkout, must not see Kafka, Pub/Sub, NATS, AMQP,
# toxiproxy, cobra, pglogrepl or the OTel SDK in `go list -m all`, and sees at
# most MAX_MODULES modules there (its own included); the same service that
# also imports migrations sees none of them either, and at most
# MAX_MODULES_MIGRATIONS. Prints the lists and the counts; exits non-zero
# when a target is missed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
max="${MAX_MODULES:-40}"
dir="$(mktemp -d "${TMPDIR:-/tmp}/outbox-consumer.XXXXXX")"
trap 'rm -rf "$dir"' EXIT

# check NAME MAX IMPORTS USES: a throwaway consumer module importing IMPORTS
# (core packages) and using USES; prints its graph and count, fails on a
# forbidden module or more than MAX modules.
check() {
  local name="$1" limit="$2" imports="$3" uses="$4" d="$dir/$1"
  mkdir -p "$d"
  cat >"$d/go.mod" <<MOD
module example.com/consumer

go 1.26

replace github.com/fencedoutbox/watermill-outbox => $repo
MOD
  {
    printf 'package main\n\nimport (\n\t"database/sql"\n\t"fmt"\n\n'
    for p in $imports; do printf '\t"github.com/fencedoutbox/watermill-outbox/%s"\n' "$p"; done
    printf ')\n\nfunc main() {\n\tvar tx *sql.Tx\n\t_, err := publisher.New(tx, publisher.Config{}, nil)\n\tfmt.Println(err, %s)\n}\n' "$uses"
  } >"$d/main.go"
  local mods n
  mods="$(cd "$d" && go get github.com/fencedoutbox/watermill-outbox@v0.0.0 >/dev/null 2>&1 || true
    go mod tidy && go build ./... && go list -m all)"
  echo "$mods"
  n="$(wc -l <<<"$mods")"
  echo "consumer module graph ($name): $n modules (target: at most $limit)"
  for pat in 'IBM/sarama' 'twmb/franz-go' 'segmentio/kafka-go' 'confluent' 'watermill-kafka' \
    'cloud.google.com/go/pubsub' 'watermill-googlecloud' 'nats-io/' 'watermill-nats' \
    'amqp' 'toxiproxy' 'spf13/cobra' 'jackc/pglogrepl' 'go.opentelemetry.io/otel/sdk'; do
    if hits="$(grep -i -- "$pat" <<<"$mods")"; then
      echo "FORBIDDEN in the consumer's graph ($name, $pat):"; echo "$hits"; fail=1
    fi
  done
  if (( n > limit )); then echo "too many modules ($name): $n > $limit"; fail=1; fi
}

export GOWORK=off GOFLAGS=-mod=mod
fail=0
check relay "$max" "forwarder inbox publisher" "forwarder.Config{}, inbox.Config{}"
# With migrations: goose's go.mod lists the SQL drivers of its other
# dialects (ClickHouse, MySQL, SQL Server, SQLite, YDB, Vertica, libsql).
# They are in the graph, not in the build; the README says so.
check migrations "${MAX_MODULES_MIGRATIONS:-100}" "forwarder inbox migrations publisher" "forwarder.Config{}, inbox.Config{}, migrations.Up"
exit "$fail"
