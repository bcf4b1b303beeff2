#!/usr/bin/env bash
# The dependency target of the core module (issue 15): a service module
# outside this repository that imports publisher, forwarder and inbox, with a
# replace to this checkout, must not see Kafka, Pub/Sub, NATS, AMQP,
# toxiproxy, cobra, pglogrepl or the OTel SDK in `go list -m all`, and sees at
# most MAX_MODULES modules there (its own included). Prints the list and the
# count; exits non-zero when the target is missed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
max="${MAX_MODULES:-40}"
dir="$(mktemp -d "${TMPDIR:-/tmp}/outbox-consumer.XXXXXX")"
trap 'rm -rf "$dir"' EXIT

cat >"$dir/go.mod" <<MOD
module example.com/consumer

go 1.26

replace github.com/fencedoutbox/watermill-outbox => $repo
MOD
cat >"$dir/main.go" <<'GO'
package main

import (
	"database/sql"
	"fmt"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

func main() {
	var tx *sql.Tx
	_, err := publisher.New(tx, publisher.Config{}, nil)
	fmt.Println(err, forwarder.Config{}, inbox.Config{})
}
GO
cd "$dir"
export GOWORK=off GOFLAGS=-mod=mod
go get github.com/fencedoutbox/watermill-outbox@v0.0.0 >/dev/null 2>&1 || true
go mod tidy
go build ./...
mods="$(go list -m all)"
echo "$mods"
n="$(wc -l <<<"$mods")"
echo "consumer module graph: $n modules (target: at most $max)"
fail=0
for pat in 'IBM/sarama' 'twmb/franz-go' 'segmentio/kafka-go' 'confluent' 'watermill-kafka' \
  'cloud.google.com/go/pubsub' 'watermill-googlecloud' 'nats-io/' 'watermill-nats' \
  'amqp' 'toxiproxy' 'spf13/cobra' 'jackc/pglogrepl' 'go.opentelemetry.io/otel/sdk'; do
  if hits="$(grep -i -- "$pat" <<<"$mods")"; then
    echo "FORBIDDEN in the consumer's graph ($pat):"; echo "$hits"; fail=1
  fi
done
if (( n > max )); then echo "too many modules: $n > $max"; fail=1; fi
exit "$fail"
