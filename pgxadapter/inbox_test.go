package pgxadapter_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/pgxadapter"
)

func TestInboxOnPgxProcessesAMessageOnceWithItsFollowUp(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	p := pool(t, s)
	_, err := p.Exec(ctx, `CREATE TABLE effects (message_id text PRIMARY KEY)`)
	require.NoError(t, err)
	mw, err := pgxadapter.InboxMiddleware(p, "billing", inbox.Config{TxOptions: &sql.TxOptions{Isolation: sql.LevelReadCommitted}})
	require.NoError(t, err)
	fail := errors.New("card declined")
	failing := true
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		tx := pgxadapter.InboxTx(msg.Context())
		require.NotNil(t, tx)
		require.Nil(t, inbox.Tx(msg.Context()), "no database/sql transaction here")
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effects VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		follow := message.NewMessage("follow-"+msg.UUID, nil)
		if err := inbox.Publisher(msg.Context()).Publish("receipts", follow); err != nil {
			return nil, err
		}
		if failing {
			return nil, fail
		}
		return nil, nil
	})
	m := message.NewMessage(watermill.NewUUID(), nil)
	envelope.SetCorrelationID(m, "corr-1")

	_, err = h(m)
	require.ErrorIs(t, err, fail, "the handler's error, nothing committed")
	require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM effects`))
	require.Zero(t, s.Count(t, ""))
	require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox`))

	failing = false
	_, err = h(m)
	require.NoError(t, err)
	_, err = h(m) // the redelivery is acked without a second effect
	require.NoError(t, err)
	require.Equal(t, 1, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM effects`))
	require.Equal(t, 1, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox WHERE consumer = 'billing' AND message_id = $1`, m.UUID))
	require.Equal(t, 1, s.Count(t, "message_id = $1 AND causation_id = $2 AND correlation_id = 'corr-1'", "follow-"+m.UUID, m.UUID))
}

func TestInboxOnPgxRefusals(t *testing.T) {
	s := testdb.New(t)
	p := pool(t, s)
	_, err := pgxadapter.InboxMiddleware(nil, "billing", inbox.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = pgxadapter.InboxMiddleware(p, "", inbox.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = pgxadapter.InboxMiddleware(p, "billing", inbox.Config{TxOptions: &sql.TxOptions{ReadOnly: true}})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = pgxadapter.InboxMiddleware(p, "billing", inbox.Config{TxOptions: &sql.TxOptions{Isolation: sql.LevelLinearizable}})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)

	mw, err := pgxadapter.InboxMiddleware(p, "billing", inbox.Config{})
	require.NoError(t, err)
	_, err = mw(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage("", nil))
	require.ErrorIs(t, err, outbox.ErrMessageIDRequired)
	require.Nil(t, pgxadapter.InboxTx(context.Background()))
}
