// Package envelope converts between watermill messages and messaging_outbox
// rows, in both directions, without losing or inventing anything. Two values
// come back normalised, not as written: msg.occurred_at in UTC at
// microsecond precision (the column's), and the correlation id, which has
// one column: when msg.correlation_id and watermill's "correlation_id" differ,
// msg.correlation_id wins and both keys come back with it.
//
// Write side ([ToRow]): msg.UUID is the message id (never re-minted), the
// canonical metadata keys (KeyTenant, KeyCorrelationID, ... all under the
// reserved "msg." namespace, set with the typed setters such as [SetTenant])
// and watermill's "correlation_id" go to their own columns, the
// OpenTelemetry trace context of msg.Context() goes to traceparent,
// tracestate and baggage, and every other key goes to the headers column. A
// "msg." key that is not canonical is refused (OUTBOX_RESERVED_HEADER), as
// are NUL bytes and invalid UTF-8 (OUTBOX_INVALID_HEADER) and a bad tenant
// slug (OUTBOX_INVALID_TENANT). msg.occurred_at must lie after
// 0001-01-01T00:00:00Z (exclusive: that instant, to the microsecond, is the
// zero time.Time, which means absent) and in year 9999 or before; anything
// else is refused (OUTBOX_INVALID_METADATA).
//
// Read side ([ToMessage]): the same message comes back, with each canonical
// column as metadata under its key, occurred_at defaulting to created_at,
// producer defaulting to Options.Producer (empty unless the caller sets it,
// e.g. forwarder.Config.Producer), and the stored trace context in
// msg.Context(). A stored header with a reserved name is refused, never
// overwritten, and so is a row whose occurred_at (or created_at) lies
// outside the years 0001-9999 RFC 3339 can write (a row written by SQL):
// OUTBOX_CORRUPT_ROW, which the relay parks as FAILED.
//
// Precision: msg.occurred_at is kept to the microsecond, as the
// occurred_at column (timestamptz) keeps it. [SetOccurredAt] and [ToRow]
// truncate a finer value, so the string a consumer receives equals the one
// SetOccurredAt wrote; nothing else about a message is rounded.
//
// Headers are a flat string map stored as jsonb and encoded with
// encoding/json ([EncodeHeaders], [DecodeHeaders]); values ending in a
// backslash, quotes, control characters and emoji round-trip.
package envelope
