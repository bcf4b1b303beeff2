package publisher_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// listen subscribes a dedicated connection to channel and returns its
// notifications. Each test uses its own channel: NOTIFY is database-wide and
// other packages' tests share the server.
func listen(t *testing.T, url, channel string) <-chan *pq.Notification {
	t.Helper()
	l := pq.NewListener(url, 10*time.Millisecond, time.Second, nil)
	t.Cleanup(func() { _ = l.Close() })
	require.NoError(t, l.Listen(channel))
	return l.NotificationChannel()
}

// next waits for the next notification; the timeout only bounds a failure.
func next(t *testing.T, ch <-chan *pq.Notification) *pq.Notification {
	t.Helper()
	select {
	case n := <-ch:
		require.NotNil(t, n, "listener reconnected")
		return n
	case <-time.After(10 * time.Second):
		t.Fatal("no notification")
		return nil
	}
}

func TestNotifyIsDeliveredOnCommitAndDroppedOnRollback(t *testing.T) {
	s := newSchema(t)
	channel := "h1_wakeup_" + randomID(t)
	notes := listen(t, s.URL, channel)
	cfg := publisher.Config{Notify: true, NotifyChannel: channel}
	ctx := context.Background()

	// A rolled-back publish queues a notification that PostgreSQL drops...
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, cfg, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("t", newMsg(t, "rolled back")))
	require.NoError(t, tx.Rollback())
	// ...so the first notification the listener sees is this marker, sent
	// after the rollback.
	_, err = s.DB.ExecContext(ctx, `SELECT pg_notify($1, 'marker')`, channel)
	require.NoError(t, err)
	require.Equal(t, "marker", next(t, notes).Extra)

	// A committed publish wakes the listener, with an empty payload.
	m := newMsg(t, "committed")
	require.NoError(t, publisher.InTx(ctx, s.DB, cfg, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish("t", m, newMsg(t, "second"))
	}))
	n := next(t, notes)
	require.Equal(t, channel, n.Channel)
	require.Empty(t, n.Extra)
	require.Equal(t, 1, s.Count(t, "message_id = $1", m.UUID), "the statement with NOTIFY still inserts")
	require.Equal(t, 2, s.Count(t, ""))
}

func TestNotifyDefaultsToTheSharedChannel(t *testing.T) {
	s := newSchema(t)
	notes := listen(t, s.URL, publisher.DefaultNotifyChannel)
	m := newMsg(t, "x")
	require.NoError(t, publisher.InTx(context.Background(), s.DB, publisher.Config{Notify: true}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish("t", m)
	}))
	// Other packages' tests may notify the shared channel too; ours arrives
	// among them, and ours is the one with the right channel.
	require.Equal(t, publisher.DefaultNotifyChannel, next(t, notes).Channel)
	require.Equal(t, 1, s.Count(t, "message_id = $1", m.UUID))
}

func TestNotifyOffSendsNothing(t *testing.T) {
	s := newSchema(t)
	channel := "h1_wakeup_" + randomID(t)
	notes := listen(t, s.URL, channel)
	require.NoError(t, publisher.InTx(context.Background(), s.DB, publisher.Config{NotifyChannel: channel}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish("t", newMsg(t, "quiet"))
	}))
	_, err := s.DB.Exec(`SELECT pg_notify($1, 'marker')`, channel)
	require.NoError(t, err)
	require.Equal(t, "marker", next(t, notes).Extra, "Notify off: the committed publish sent no notification")
	require.Equal(t, 1, s.Count(t, ""))
}
