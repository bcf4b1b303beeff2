// Package outbox holds what every package of watermill-outbox shares: the
// typed [Error] with its stable [Code]s.
//
// The product itself lives in the sub-packages:
//
//   - migrations: the embedded SQL (migrations/sql) and Up, under a
//     cross-process lock; migrations/schema checks a database is migrated
//     without importing the runner
//   - envelope: watermill message <-> outbox row, canonical metadata, header codec
//   - publisher: a watermill message.Publisher bound to the caller's *sql.Tx
//     (sqlv3 and sqlv4: drop-in watermill-sql schema adapters, own modules)
//   - pgxadapter: publishing, NOTIFY wake-up and the inbox on pgx's own
//     pgx.Tx and connections (own module)
//   - fencing: the claim statement and every fenced state transition
//   - forwarder: the fenced relay that replaces watermill's components/forwarder
//     (forwarder/prommetrics: its Prometheus collectors)
//   - retention: bounded cleanup of published rows and of the inbox
//     (retention/prommetrics: runs done, skipped and failed, rows removed)
//   - journal: exactly-once admin operations (redrive, purge)
//   - inbox: consumer-side de-duplication middleware
//   - relaymode: which relay kind may run (POLLING or CDC), recorded in the
//     database; the switch between them, refused while the other kind is
//     live; the heartbeats of every relay of either kind
//   - debezium: the Debezium outbox event router configuration generated
//     from the schema, and the model of the records it emits
//   - cdcrelay: a built-in CDC relay that streams inserts from a logical
//     replication slot instead of polling, beating as a CDC relay (own module)
//   - status: the operator queries behind `outboxctl status` and a
//     Prometheus backlog collector
//   - transport: publishers and error classifiers per broker (amqp,
//     googlecloud, kafka, nats; one module each), the classifiers returning
//     forwarder's verdicts
//
// Commands: cmd/outboxctl (operate a database, run a standalone relay) and
// cmd/outbox-bench (the benchmark). Deployment examples, alert rules and a
// dashboard are in deploy/.
//
// Guarantees: a row commits with the business change or not at all; delivery
// is at least once under one message id; a relay that lost its lease cannot
// overwrite the truth; retry clocks and budgets live in the row.
package outbox
