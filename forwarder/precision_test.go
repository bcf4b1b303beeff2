package forwarder_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// msg.occurred_at round-trips exactly what the column keeps: a time with
// nanoseconds (which PostgreSQL would round to the microsecond, here up) is
// truncated by SetOccurredAt, so the string the consumer receives equals the
// string the producer's message carried.
func TestOccurredAtStringSurvivesTheRelayExactly(t *testing.T) {
	s := newDB(t)
	sent := map[string]string{}
	ctx := context.Background()
	for i, at := range []time.Time{
		time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.UTC),                  // rounds up in PostgreSQL
		time.Date(2026, 3, 4, 5, 6, 7, 999999999, time.FixedZone("x", 3600)), // rounds into the next second
		time.Date(2026, 3, 4, 5, 6, 7, 500, time.UTC),                        // below a microsecond
	} {
		m := message.NewMessage(string(rune('a'+i)), []byte("p"))
		envelope.SetOccurredAt(m, at)
		sent[m.UUID] = m.Metadata.Get(envelope.KeyOccurredAt)
		require.NoError(t, publisher.InTx(ctx, s.DB, publisher.Config{}, func(ctx context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
			return pub.Publish("orders", m)
		}))
	}
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{})
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, rep.Published)
	for _, d := range rec.delivered {
		require.Equal(t, sent[d.msg.UUID], d.msg.Metadata.Get(envelope.KeyOccurredAt), d.msg.UUID)
	}
	require.Len(t, rec.delivered, 3)
}
