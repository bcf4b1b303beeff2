package publisher_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

type orderRecorder struct{ ids []string }

func (r *orderRecorder) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		r.ids = append(r.ids, m.UUID)
	}
	return nil
}
func (r *orderRecorder) Close() error { return nil }

// Two transactions write one ordering key and share no other lock; the one
// that took the lower seq commits last. Without LockOrderingKeys the relay,
// which publishes a key in seq order among committed rows, publishes the
// later-committed row second though its seq is lower: the key goes out
// "second, first". With it, the second writer waits inside its INSERT for the
// first to commit and gets the later seq: the key goes out in commit order.
func TestLockOrderingKeysMakesSeqOrderCommitOrder(t *testing.T) {
	for _, c := range []struct {
		name string
		lock bool
		want []string
	}{
		{"without the lock the key is reordered", false, []string{"second", "first"}},
		{"with the lock the key keeps commit order", true, []string{"first", "second"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			s := newSchema(t)
			s.DB.SetMaxOpenConns(6)
			cfg := publisher.Config{LockOrderingKeys: c.lock}
			keyed := func(id string) *message.Message {
				m := message.NewMessage(id, []byte(id))
				envelope.SetOrderingKey(m, "order-42")
				return m
			}
			rec := &orderRecorder{}
			fwd, err := forwarder.New(s.DB, rec, nil, forwarder.Config{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = fwd.Close() })

			tx1 := begin(t, s.DB, nil)
			p1, err := publisher.New(tx1, cfg, nil)
			require.NoError(t, err)
			require.NoError(t, p1.Publish("orders", keyed("first")))

			second := make(chan error, 1)
			go func() {
				tx2, err := s.DB.BeginTx(ctx, nil)
				if err != nil {
					second <- err
					return
				}
				p2, err := publisher.New(tx2, cfg, nil)
				if err == nil {
					err = p2.Publish("orders", keyed("second"))
				}
				if err != nil {
					_ = tx2.Rollback()
					second <- err
					return
				}
				second <- tx2.Commit()
			}()
			if c.lock {
				// The second writer waits on the first one's key lock.
				await.Until(t, func() bool {
					var waiting int
					require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&waiting))
					return waiting > 0
				}, "the second writer waits on the first one's key lock")
			} else {
				require.NoError(t, <-second)
			}
			rep, err := fwd.RunOnce(ctx)
			require.NoError(t, err)
			if c.lock {
				require.Zero(t, rep.Claimed, "nothing of the key is committed yet")
			}
			require.NoError(t, tx1.Commit())
			if c.lock {
				require.NoError(t, <-second)
			}
			for len(rec.ids) < 2 {
				rep, err := fwd.RunOnce(ctx)
				require.NoError(t, err)
				require.NotZero(t, rep.Claimed, "both rows are committed: a pass must find one")
			}
			require.Equal(t, c.want, rec.ids)
			var first, sec int64
			require.NoError(t, s.DB.QueryRow(`SELECT seq FROM messaging_outbox WHERE message_id = 'first'`).Scan(&first))
			require.NoError(t, s.DB.QueryRow(`SELECT seq FROM messaging_outbox WHERE message_id = 'second'`).Scan(&sec))
			require.Less(t, first, sec, "first took its seq first either way")
		})
	}
}

// The lock is in the batch statement too, and in the NOTIFY and prepared
// forms: a batch of several keys publishes and commits.
func TestLockOrderingKeysInEveryStatementForm(t *testing.T) {
	ctx := context.Background()
	s := newSchema(t)
	prep, err := publisher.Prepare(ctx, s.DB)
	require.NoError(t, err)
	t.Cleanup(func() { _ = prep.Close() })
	for _, cfg := range []publisher.Config{
		{LockOrderingKeys: true},
		{LockOrderingKeys: true, Notify: true},
		{LockOrderingKeys: true, Prepared: prep},
		{LockOrderingKeys: true, Notify: true, Prepared: prep},
	} {
		for _, n := range []int{1, 3} {
			err := publisher.InTx(ctx, s.DB, cfg, func(ctx context.Context, _ *sql.Tx, p *publisher.Publisher) error {
				batch := make([]*message.Message, n)
				for i := range batch {
					batch[i] = message.NewMessage(randomID(t), []byte("x"))
					envelope.SetOrderingKey(batch[i], []string{"b", "a", "b"}[i])
				}
				return p.Publish("orders", batch...)
			})
			require.NoError(t, err)
		}
	}
	var rows int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE ordering_key IS NOT NULL`).Scan(&rows))
	require.Equal(t, 4*(1+3), rows)
}
