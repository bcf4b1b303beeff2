package inbox_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/inbox"
)

// unstorableIDs are message UUIDs PostgreSQL text cannot hold.
var unstorableIDs = map[string]string{"NUL": "a\x00b", "invalid UTF-8": "a\xffb"}

// A UUID PostgreSQL text cannot hold fails with a code, not with the
// database's error on every redelivery, and the handler never runs.
func TestUnstorableMessageIDIsRefusedWithACode(t *testing.T) {
	e := newEnv(t)
	called := false
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		called = true
		return effectHandler(msg)
	})
	for name, id := range unstorableIDs {
		t.Run(name, func(t *testing.T) {
			_, err := h(message.NewMessage(id, nil))
			require.ErrorIs(t, err, outbox.ErrInvalidHeader)
			require.False(t, called)
		})
	}
	var n int
	require.NoError(t, e.db.QueryRow(`SELECT count(*) FROM messaging_inbox`).Scan(&n))
	require.Zero(t, n)
}

// transactorSpy is a Transactor that records whether a transaction was
// begun and begins none.
type transactorSpy struct{ begun bool }

func (s *transactorSpy) InTx(context.Context, func(context.Context, inbox.DriverTx) error) error {
	s.begun = true
	return nil
}

// NewMiddlewareOn refuses such a UUID the same way, before beginning a
// transaction on the other driver.
func TestUnstorableMessageIDIsRefusedOnAnotherDriver(t *testing.T) {
	tr := &transactorSpy{}
	mw, err := inbox.NewMiddlewareOn(tr, "billing", inbox.Config{})
	require.NoError(t, err)
	h := mw(func(*message.Message) ([]*message.Message, error) {
		t.Fatal("the handler ran")
		return nil, nil
	})
	for name, id := range unstorableIDs {
		t.Run(name, func(t *testing.T) {
			_, err := h(message.NewMessage(id, nil))
			require.ErrorIs(t, err, outbox.ErrInvalidHeader)
			require.False(t, tr.begun, "no transaction is begun")
		})
	}
}
