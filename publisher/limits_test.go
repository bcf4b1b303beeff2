package publisher_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// Values the database would refuse mid-statement (aborting the caller's
// transaction with an uncoded error) are refused before any SQL, with a
// code, and the transaction goes on: an ordering key too long for its
// index, an occurred_at in year 0000 (accepted alone, refused in a batch,
// before this check).
func TestValuesTheDatabaseWouldRefuseAreRefusedFirst(t *testing.T) {
	s := newSchema(t)
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	long := message.NewMessage("long-key", []byte("x"))
	envelope.SetOrderingKey(long, strings.Repeat("k", 8000))
	require.ErrorIs(t, pub.Publish("orders", long), outbox.ErrInvalidMetadata)
	year0 := func(id string) *message.Message {
		m := message.NewMessage(id, []byte("x"))
		m.Metadata.Set(envelope.KeyOccurredAt, "0000-06-01T00:00:00Z")
		return m
	}
	require.ErrorIs(t, pub.Publish("orders", year0("y0")), outbox.ErrInvalidMetadata, "one message")
	require.ErrorIs(t, pub.Publish("orders", year0("y1"), year0("y2")), outbox.ErrInvalidMetadata, "a batch")
	require.NoError(t, pub.Publish("orders", newMsg(t, "after")), "the transaction is still usable")
	require.NoError(t, tx.Commit())
	require.Equal(t, 1, s.Count(t, ""))
}

// With no messages the topic is still checked, all of it.
func TestATopicIsCheckedWithNoMessages(t *testing.T) {
	s := newSchema(t)
	pub, err := publisher.New(begin(t, s.DB, nil), publisher.Config{}, nil)
	require.NoError(t, err)
	require.ErrorIs(t, pub.Publish(""), outbox.ErrTopicRequired)
	require.ErrorIs(t, pub.Publish("t\x00"), outbox.ErrInvalidHeader)
	require.ErrorIs(t, pub.Publish("t\xff"), outbox.ErrInvalidHeader)
	require.NoError(t, pub.Publish("orders"))
}

// The limits are configurable: a lower limit refuses what the default takes,
// a negative one lifts it, and header values stay free text (control
// characters other than NUL round-trip there).
func TestConfiguredInputLimits(t *testing.T) {
	s := newSchema(t)
	publish := func(cfg publisher.Config, topic string, m *message.Message) error {
		tx := begin(t, s.DB, nil)
		pub, err := publisher.New(tx, cfg, nil)
		require.NoError(t, err)
		err = pub.Publish(topic, m)
		if err != nil {
			require.NoError(t, tx.Rollback())
			return err
		}
		return tx.Commit()
	}
	m := message.NewMessage(randomID(t), []byte("0123456789"))
	err := publish(publisher.Config{MaxPayloadBytes: 9}, "t", m)
	require.ErrorIs(t, err, publisher.ErrPayloadTooLarge)
	require.Contains(t, err.Error(), "MaxPayloadBytes")
	require.ErrorIs(t, publish(publisher.Config{MaxDestinationLength: 3}, "four", newMsg(t, "x")), publisher.ErrDestinationTooLong)
	h := newMsg(t, "x")
	h.Metadata.Set("k", "0123456789")
	require.ErrorIs(t, publish(publisher.Config{MaxHeaderBytes: 10}, "t", h), publisher.ErrHeadersTooLarge)
	require.Zero(t, s.Count(t, ""), "refusals write nothing")

	long := strings.Repeat("t", publisher.DefaultMaxDestinationLength+1)
	require.NoError(t, publish(publisher.Config{MaxDestinationLength: -1, MaxPayloadBytes: 10, MaxHeaderBytes: 11}, long, h))
	free := newMsg(t, "x")
	free.Metadata.Set("note", "line one\nline two\x1b[1m")
	require.NoError(t, publish(publisher.Config{}, "t", free))
	require.Equal(t, "line one\nline two\x1b[1m", readRow(t, s.DB, free.UUID).Headers["note"])
	require.Equal(t, 2, s.Count(t, ""))
}
