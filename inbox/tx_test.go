package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"runtime"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Config.TxOptions reaches the consumer's transaction (through
// publisher.InTxWith).
func TestTxOptionsReachTheConsumerTransaction(t *testing.T) {
	e := newEnv(t)
	var serverDefault string
	require.NoError(t, e.db.QueryRow(`SHOW default_transaction_isolation`).Scan(&serverDefault))
	for i, tc := range []struct {
		opts *sql.TxOptions
		want string
	}{
		{nil, serverDefault},
		{&sql.TxOptions{Isolation: sql.LevelRepeatableRead}, "repeatable read"},
		{&sql.TxOptions{Isolation: sql.LevelSerializable}, "serializable"},
	} {
		var got string
		h := inbox.Middleware(e.db, "billing", inbox.Config{TxOptions: tc.opts})(func(msg *message.Message) ([]*message.Message, error) {
			if err := inbox.Tx(msg.Context()).QueryRowContext(msg.Context(), `SHOW transaction_isolation`).Scan(&got); err != nil {
				return nil, err
			}
			return effectHandler(msg)
		})
		id := "iso-" + string(rune('a'+i))
		_, err := h(message.NewMessage(id, nil))
		require.NoError(t, err)
		require.Equal(t, tc.want, got)
		require.Equal(t, 1, e.applied(t, id))
		require.Equal(t, 1, e.inboxRows(t, "billing", id))
	}
}

// Config.Logger is the follow-up publisher's logger and the middleware's.
func TestLoggerReachesTheFollowUpPublisher(t *testing.T) {
	e := newEnv(t)
	logger := watermill.NewCaptureLogger()
	h := inbox.Middleware(e.db, "billing", inbox.Config{Logger: logger})(func(msg *message.Message) ([]*message.Message, error) {
		return nil, inbox.Publisher(msg.Context()).Publish("t", message.NewMessage("follow-"+msg.UUID, nil))
	})
	for range 2 {
		_, err := h(message.NewMessage("log-1", nil))
		require.NoError(t, err)
	}
	require.Equal(t, 1, e.s.Count(t, "message_id = 'follow-log-1'"))
	require.NotEmpty(t, logger.Captured()[watermill.TraceLogLevel], "the follow-up publisher logged")
	require.True(t, logger.Has(watermill.CapturedMessage{
		Level:  watermill.DebugLogLevel,
		Msg:    "inbox: message already processed, skipping",
		Fields: watermill.LogFields{"consumer": "billing", "message_uuid": "log-1"},
	}))
}

// A handler that swallows a database error returns nil, but the aborted
// transaction cannot commit: the message is nacked with an error naming it,
// and its redelivery is processed as new.
func TestFailedCommitNacksAndNamesTheMessage(t *testing.T) {
	e := newEnv(t)
	swallow := true
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := effectHandler(msg); err != nil {
			return nil, err
		}
		if swallow {
			_, _ = inbox.Tx(msg.Context()).ExecContext(msg.Context(), `SELECT 1/0`)
		}
		return nil, nil
	})
	_, err := h(message.NewMessage("commit-1", nil))
	require.True(t, testdb.CommitOfAbortedTx(err), "%v", err)
	require.ErrorContains(t, err, "inbox: commit-1: ")
	require.Equal(t, 0, e.applied(t, "commit-1"))
	require.Equal(t, 0, e.inboxRows(t, "billing", "commit-1"))

	swallow = false
	_, err = h(message.NewMessage("commit-1", nil))
	require.NoError(t, err)
	require.Equal(t, 1, e.applied(t, "commit-1"))
}

// A handler that leaves its goroutine (runtime.Goexit) rolls back like one
// that panics: nothing commits and the connection is not held.
func TestHandlerGoexitRollsBack(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel) // frees the connection should the transaction stay open
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := effectHandler(msg); err != nil {
			return nil, err
		}
		runtime.Goexit()
		return nil, errors.New("unreachable")
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		m := message.NewMessage("goexit-1", nil)
		m.SetContext(ctx)
		_, _ = h(m)
	}()
	<-done
	require.Zero(t, e.db.Stats().InUse, "the connection went back to the pool")
	require.Equal(t, 0, e.applied(t, "goexit-1"))
	require.Equal(t, 0, e.inboxRows(t, "billing", "goexit-1"))
}
