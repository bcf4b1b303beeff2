// Package outbox holds what every package of watermill-outbox shares: the
// typed [Error] with its stable [Code]s.
//
// The product itself lives in the sub-packages:
//
//   - migrations: the embedded SQL and Up, under a cross-process lock
//   - envelope: watermill message <-> outbox row, canonical metadata, header codec
//   - publisher: a watermill message.Publisher bound to the caller's *sql.Tx
//   - fencing: the claim statement and every fenced state transition
//   - forwarder: the fenced relay that replaces watermill's components/forwarder
//   - retention: bounded cleanup of published rows and of the inbox
//   - journal: exactly-once admin operations (redrive, purge)
//   - inbox: consumer-side de-duplication middleware
//   - debezium: CDC connector configuration and relay-mode exclusivity
//
// Guarantees: a row commits with the business change or not at all; delivery
// is at least once under one message id; a relay that lost its lease cannot
// overwrite the truth; retry clocks and budgets live in the row.
package outbox
