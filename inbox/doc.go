// Package inbox makes a consumer's effect happen once per message id, even
// though the relay delivers at least once.
//
// [Middleware] wraps a watermill handler. For every message it begins a
// transaction on the consumer's database and inserts (consumer, message id)
// into messaging_inbox with ON CONFLICT DO NOTHING, then:
//
//   - a message id this consumer has recorded before is acknowledged without
//     running the handler (the redelivery's effect is not repeated);
//   - otherwise the handler runs inside that transaction: it reaches it with
//     [Tx](msg.Context()) and emits follow-up events atomically with
//     [Publisher](msg.Context()), an outbox publisher bound to the same
//     transaction. When the handler returns nil the transaction commits, so
//     the effect, the inbox record and the follow-ups become durable
//     together; when it returns an error (or panics, the panic is re-raised)
//     everything rolls back, the message is nacked, and its redelivery is
//     processed as if it were new.
//
// Two concurrent deliveries of one id cannot both run the handler to commit:
// the second INSERT waits on the first's uncommitted primary key and, once
// the first commits, sees the conflict and skips. (If the first rolls back,
// the second proceeds.)
//
// Follow-ups published through [Publisher] get msg.causation_id = the consumed
// message id and the consumed message's correlation id, unless they set their
// own.
//
// A handler must not return produced messages (watermill's return value for
// messages the router publishes after the handler). The router would publish
// them outside the transaction, after the inbox record committed: if that
// publish failed, the redelivery would be skipped as already processed and the
// messages would be lost. So when a handler returns a non-empty slice the
// middleware rolls everything back (no effect, no inbox record, no
// follow-ups) and fails with INBOX_PRODUCED_MESSAGES ([ErrProducedMessages]);
// the message is nacked. Emit follow-ups with [Publisher] instead: they commit
// with the effect.
//
// The inbox only helps when the effect lives in the same database as
// messaging_inbox and is written through [Tx]. Consumer names are part of
// the key: two handlers that must each see every message need two names.
package inbox
