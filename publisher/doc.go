// Package publisher is the write side of the outbox: a watermill
// message.Publisher bound to the caller's *sql.Tx, so a message intent is
// stored in messaging_outbox in the same local commit as the business change.
//
//	err := publisher.InTx(ctx, db, publisher.Config{Producer: "billing"},
//		func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
//			if _, err := tx.ExecContext(ctx, `UPDATE orders SET paid = true WHERE id = $1`, id); err != nil {
//				return err
//			}
//			return pub.Publish("orders.paid", msg)
//		})
//
// InTxWith does the same with options: the transaction's sql.TxOptions
// (isolation level, read-only) and a logger for the Publisher.
//
// Guarantees:
//
//   - The rows and the business change commit together or not at all: the
//     publisher writes with the caller's transaction and never commits or
//     rolls back itself. Publishing with a nil, finished, read-only or
//     aborted transaction is refused (OUTBOX_TRANSACTION_REQUIRED).
//   - One Publish call is one INSERT statement for all its messages, from a
//     fixed statement text (a VALUES row for one message, array parameters
//     and unnest for more, the payloads end to end in one bytea parameter
//     cut apart on the server; values are always bound, never spliced into
//     the SQL), so
//     its cost is one statement whatever the batch size, and the messages get
//     seq values in the order given.
//   - Every message of a call is validated by the envelope before anything is
//     sent, so a refused call writes no row. Refusals are *outbox.Error with
//     stable codes (see Publisher.Publish). A refusal that only the database
//     can make (a message id already stored by an earlier call) aborts the
//     caller's transaction, as any failed statement does in PostgreSQL: roll
//     back.
//   - msg.UUID is the message id, end to end; it is never re-minted.
//   - A Publisher is safe for concurrent use (its statements are serialised
//     on the transaction), Close is idempotent, and Publish after Close is
//     refused (OUTBOX_PUBLISHER_CLOSED).
//   - With Config.Notify the same statement queues a NOTIFY on
//     DefaultNotifyChannel (or Config.NotifyChannel); PostgreSQL delivers it
//     when the transaction commits and drops it on rollback, so a listening
//     relay wakes up exactly when there is committed work.
//   - The statement carries only the columns the call's messages fill (one
//     of three fixed texts: 4, 11 or 21 columns), so the common message does
//     not pay for parsing 21 parameters; the stored rows are the same.
//
// Cost: one statement per Publish call. Unprepared, lib/pq sends it in two
// round trips (Parse/Describe, then Bind/Execute) and PostgreSQL parses and
// plans it every time. With Config.Prepared (see Prepare, built once per
// *sql.DB) it is one round trip and no planning: in cmd/outbox-bench that
// made a one-message transaction about 1.3x faster. Putting several messages
// in one Publish call is the biggest lever: one statement, one commit.
//
// Services that already publish through watermill-sql keep their publisher
// and swap the schema adapter: see the sub-packages sqlv3 and sqlv4.
package publisher
