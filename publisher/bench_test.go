package publisher_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// rawInsert is the baseline the publisher is measured against: the smallest
// INSERT that stores a message.
const rawInsert = `INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ($1, $2, $3, $4)`

func benchTx(b *testing.B, cfg publisher.Config, raw bool) {
	s := newSchemaB(b)
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		m := message.NewMessage(randomID(b), []byte(`{"order":42}`))
		m.Metadata.Set("x-app", "v")
		tx, err := s.DB.BeginTx(ctx, nil)
		require.NoError(b, err)
		if raw {
			_, err = tx.ExecContext(ctx, rawInsert, m.UUID, "orders.paid", []byte(m.Payload), `{"x-app":"v"}`)
		} else {
			var pub *publisher.Publisher
			pub, err = publisher.New(tx, cfg, nil)
			require.NoError(b, err)
			err = pub.Publish("orders.paid", m)
		}
		require.NoError(b, err)
		require.NoError(b, tx.Commit())
	}
}

func BenchmarkInsertRaw(b *testing.B)             { benchTx(b, publisher.Config{}, true) }
func BenchmarkInsertPublisher(b *testing.B)       { benchTx(b, publisher.Config{Producer: "billing"}, false) }
func BenchmarkInsertPublisherNotify(b *testing.B) { benchTx(b, publisher.Config{Notify: true}, false) }
