package publisher

import (
	"cmp"
	"strings"
	"unicode/utf8"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
)

// DefaultNotifyChannel is the channel the publisher notifies when
// Config.Notify is on and Config.NotifyChannel is empty. The forwarder's
// wake-up listener LISTENs on the same constant, so the two agree unless both
// are configured otherwise.
const DefaultNotifyChannel = "messaging_outbox_wakeup"

// maxChannelLength is PostgreSQL's identifier limit (NAMEDATALEN - 1): a
// longer channel name makes pg_notify fail inside the caller's transaction,
// so it is refused at construction instead.
const maxChannelLength = 63

// Config tunes a Publisher. The zero value is valid: no producer, no wake-up.
type Config struct {
	// Producer is written to the producer column of messages that do not set
	// envelope.KeyProducer themselves. Empty leaves the column NULL.
	Producer string

	// Notify sends a NOTIFY on NotifyChannel from the same statement that
	// inserts the rows, so a listening relay wakes up when the caller's
	// transaction commits (PostgreSQL discards the notification on rollback).
	// It costs no extra round trip. Off by default: the relay polls anyway.
	Notify bool

	// NotifyChannel is the channel used when Notify is on. Empty means
	// DefaultNotifyChannel. At most 63 bytes, valid UTF-8, no NUL.
	NotifyChannel string

	// LockOrderingKeys makes seq order equal commit order within an ordering
	// key: the INSERT itself (no extra round trip) takes a
	// transaction-scoped advisory lock on every ordering key it writes
	// before its rows get their seqs, so a second transaction writing the
	// same key waits until the first commits or rolls back. Without it, two
	// transactions that write one key concurrently and share no other lock
	// can commit out of seq order, and the relay, which publishes a key in
	// seq order among committed rows, may then publish the later row first.
	// Turn it on unless the producers of a key already serialise (for
	// example by updating the same aggregate row first). Within one
	// statement the keys are locked in key order; a transaction that
	// publishes several keys in several calls, against another that does so
	// in the opposite order, can deadlock (PostgreSQL aborts one with 40P01):
	// publish a transaction's keys in one call, or in a fixed order.
	LockOrderingKeys bool

	// KeyUnkeyedByTopic writes the topic as the ordering key of every
	// message that sets none (envelope.SetOrderingKey), so the forwarder
	// publishes each topic's unkeyed messages one after another in seq
	// order, as watermill's components/forwarder did, instead of up to
	// Concurrency at once, where neighbours can be published swapped.
	// Messages that set an ordering key keep theirs.
	//
	// The cost: a topic's unkeyed messages then drain as one chain (one
	// publish in flight per topic instead of up to Concurrency), a message
	// that fails holds its topic's later messages back until it is published
	// or parked, the consumer sees msg.ordering_key set to the topic, and
	// with LockOrderingKeys the transactions publishing to one topic
	// serialise. Off (the zero value) in publisher.Publisher; on by default
	// in the watermill-sql drop-in adapters (publisher/sqlv3, publisher/sqlv4),
	// where consumers had watermill's per-topic order. A topic longer than
	// envelope.MaxOrderingKeyLength (1024 bytes, only possible with
	// MaxDestinationLength raised) is then refused with
	// OUTBOX_DESTINATION_TOO_LONG.
	KeyUnkeyedByTopic bool

	// Prepared, when set, runs the INSERT as a prepared statement (see
	// Prepare): one round trip per Publish instead of two, no parsing or
	// planning per call. The transaction must belong to the *sql.DB it was
	// prepared on. Nil (the default) sends the statement unprepared.
	Prepared *Prepared

	// MaxPayloadBytes refuses a message whose payload is longer
	// (OUTBOX_PAYLOAD_TOO_LARGE). Zero means DefaultMaxPayloadBytes (10 MiB),
	// negative means no limit.
	MaxPayloadBytes int
	// MaxHeaderBytes refuses a message whose metadata, every key and value
	// counted (canonical msg.* ones too), is longer
	// (OUTBOX_HEADERS_TOO_LARGE). Zero means DefaultMaxHeaderBytes (64 KiB),
	// negative means no limit.
	MaxHeaderBytes int
	// MaxDestinationLength refuses a longer topic
	// (OUTBOX_DESTINATION_TOO_LONG). Zero means DefaultMaxDestinationLength
	// (249 bytes), negative means no limit.
	MaxDestinationLength int
}

// withDefaults is the one place defaults are filled in.
func (c Config) withDefaults() Config {
	c.NotifyChannel = cmp.Or(c.NotifyChannel, DefaultNotifyChannel)
	return c
}

// Validate reports an OUTBOX_INVALID_CONFIG error naming the field to change.
// Empty fields are validated as their defaults, so the zero Config is valid.
func (c Config) Validate() error {
	const op = "publisher.Config"
	c = c.withDefaults()
	if err := checkConfigText("Producer", c.Producer); err != nil {
		return err
	}
	if i := pgtext.ControlAt(c.Producer); i >= 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, op,
			"Producer has a control character at byte %d; it is written to every row, printed and logged, so every Publish would refuse it: use printable text", i)
	}
	if err := checkConfigText("NotifyChannel", c.NotifyChannel); err != nil {
		return err
	}
	if len(c.NotifyChannel) > maxChannelLength {
		return outbox.Errorf(outbox.CodeInvalidConfig, op,
			"NotifyChannel is %d bytes; PostgreSQL channel names are at most %d bytes, choose a shorter name",
			len(c.NotifyChannel), maxChannelLength)
	}
	return nil
}

func checkConfigText(field, v string) error {
	if strings.IndexByte(v, 0) >= 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, "publisher.Config", "%s contains a NUL byte; remove it", field)
	}
	if !utf8.ValidString(v) {
		return outbox.Errorf(outbox.CodeInvalidConfig, "publisher.Config", "%s is not valid UTF-8", field)
	}
	return nil
}
