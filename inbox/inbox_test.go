package inbox_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/leakcheck"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

func TestMain(m *testing.M) {
	leakcheck.VerifyTestMain(m,
		leakcheck.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		leakcheck.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
	)
}

const (
	createEffects = `CREATE TABLE effects (id text PRIMARY KEY, applied integer NOT NULL)`
	applyEffect   = `INSERT INTO effects (id, applied) VALUES ($1, 1) ON CONFLICT (id) DO UPDATE SET applied = effects.applied + 1`
)

type env struct {
	s       *testdb.Schema
	db      *sql.DB
	appName string
}

// newEnv gives a migrated schema with an effects table; its pool carries a
// unique application_name so the test can find its own sessions in
// pg_stat_activity on a shared server.
func newEnv(t *testing.T) *env {
	t.Helper()
	s := testdb.New(t)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	app := "inbox_test_" + hex.EncodeToString(b)
	db, err := testdb.OpenURL(s.URL + "&application_name=" + app) // the driver under test (OUTBOX_TEST_DRIVER)
	require.NoError(t, err)
	db.SetMaxOpenConns(6)
	t.Cleanup(func() { _ = db.Close() })
	_, err = db.Exec(createEffects)
	require.NoError(t, err)
	return &env{s: s, db: db, appName: app}
}

func (e *env) applied(t *testing.T, id string) int {
	t.Helper()
	var n int
	err := e.db.QueryRow(`SELECT applied FROM effects WHERE id = $1`, id).Scan(&n)
	if errors.Is(err, sql.ErrNoRows) {
		return 0
	}
	require.NoError(t, err)
	return n
}

func (e *env) inboxRows(t *testing.T, consumer, id string) int {
	t.Helper()
	var n int
	require.NoError(t, e.db.QueryRow(`SELECT count(*) FROM messaging_inbox WHERE consumer = $1 AND message_id = $2`, consumer, id).Scan(&n))
	return n
}

// effectHandler applies the message's effect through the inbox transaction.
func effectHandler(msg *message.Message) ([]*message.Message, error) {
	tx := inbox.Tx(msg.Context())
	if tx == nil {
		return nil, errors.New("no inbox transaction in context")
	}
	_, err := tx.ExecContext(msg.Context(), applyEffect, msg.UUID)
	return nil, err
}

func TestRedeliveryChangesStateOnce(t *testing.T) {
	e := newEnv(t)
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(effectHandler)
	for range 3 {
		_, err := h(message.NewMessage("m-1", []byte("x")))
		require.NoError(t, err)
	}
	require.Equal(t, 1, e.applied(t, "m-1"))
	require.Equal(t, 1, e.inboxRows(t, "billing", "m-1"))

	// Another consumer is another key: it processes the same id once too.
	h2 := inbox.Middleware(e.db, "shipping", inbox.Config{})(effectHandler)
	_, err := h2(message.NewMessage("m-1", []byte("x")))
	require.NoError(t, err)
	require.Equal(t, 2, e.applied(t, "m-1"))
}

func TestHandlerErrorRollsBackEffectAndInboxRecord(t *testing.T) {
	e := newEnv(t)
	boom := errors.New("downstream said no")
	failing := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := effectHandler(msg); err != nil {
			return nil, err
		}
		return nil, boom
	})
	_, err := failing(message.NewMessage("m-2", nil))
	require.ErrorIs(t, err, boom)
	require.Equal(t, 0, e.applied(t, "m-2"))
	require.Equal(t, 0, e.inboxRows(t, "billing", "m-2"))

	// The redelivery is processed as new.
	ok := inbox.Middleware(e.db, "billing", inbox.Config{})(effectHandler)
	_, err = ok(message.NewMessage("m-2", nil))
	require.NoError(t, err)
	require.Equal(t, 1, e.applied(t, "m-2"))
	require.Equal(t, 1, e.inboxRows(t, "billing", "m-2"))
}

func TestHandlerPanicRollsBackAndRepanics(t *testing.T) {
	e := newEnv(t)
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := effectHandler(msg); err != nil {
			return nil, err
		}
		panic("handler bug")
	})
	require.PanicsWithValue(t, "handler bug", func() { _, _ = h(message.NewMessage("m-3", nil)) })
	require.Equal(t, 0, e.applied(t, "m-3"))
	require.Equal(t, 0, e.inboxRows(t, "billing", "m-3"))
}

func TestConcurrentDeliveriesOfOneIDHaveOneEffect(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	calls := 0
	var mu sync.Mutex
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		calls++
		mu.Unlock()
		entered <- struct{}{}
		<-release // hold the first delivery's transaction open
		return effectHandler(msg)
	})

	errs := make(chan error, 2)
	go func() { _, err := h(message.NewMessage("m-4", nil)); errs <- err }()
	<-entered // the first delivery holds the uncommitted inbox key

	go func() { _, err := h(message.NewMessage("m-4", nil)); errs <- err }()
	// The second delivery's INSERT waits on the first's key (a lock wait
	// visible in pg_stat_activity), so it has not reached the handler.
	await.Until(t, func() bool {
		var n int
		err := e.db.QueryRow(`SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO messaging_inbox%'`, e.appName).Scan(&n)
		return err == nil && n == 1
	}, "the second delivery's INSERT waits on the first's key")

	close(release)
	require.NoError(t, <-errs)
	require.NoError(t, <-errs)
	require.Equal(t, 1, calls)
	require.Equal(t, 1, e.applied(t, "m-4"))
}

func TestConcurrentDeliveryProceedsWhenTheFirstRollsBack(t *testing.T) {
	e := newEnv(t)
	boom := errors.New("first delivery fails")
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	calls := 0
	var mu sync.Mutex
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		calls++
		first := calls == 1
		mu.Unlock()
		entered <- struct{}{}
		if _, err := effectHandler(msg); err != nil {
			return nil, err
		}
		if first {
			<-release // hold the first delivery's transaction open
			return nil, boom
		}
		return nil, nil
	})

	first := make(chan error, 1)
	go func() { _, err := h(message.NewMessage("m-4b", nil)); first <- err }()
	<-entered // the first delivery holds the uncommitted inbox key

	second := make(chan error, 1)
	go func() { _, err := h(message.NewMessage("m-4b", nil)); second <- err }()
	// The second delivery's INSERT waits on the first's key.
	await.Until(t, func() bool {
		var n int
		err := e.db.QueryRow(`SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO messaging_inbox%'`, e.appName).Scan(&n)
		return err == nil && n == 1
	}, "the second delivery's INSERT waits on the first's key")

	close(release) // the first handler fails: its transaction rolls back
	require.ErrorIs(t, <-first, boom)
	// The waiting INSERT sees no committed conflict, so the second delivery
	// runs the handler and commits.
	require.NoError(t, <-second)
	require.Equal(t, 2, calls)
	require.Equal(t, 1, e.applied(t, "m-4b"))
	require.Equal(t, 1, e.inboxRows(t, "billing", "m-4b"))
}

func TestFollowUpCommitsWithTheEffect(t *testing.T) {
	e := newEnv(t)
	fail := false
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := effectHandler(msg); err != nil {
			return nil, err
		}
		follow := message.NewMessage("invoice-for-"+msg.UUID, []byte("invoice"))
		if err := inbox.Publisher(msg.Context()).Publish("invoices", follow); err != nil {
			return nil, err
		}
		if fail {
			return nil, errors.New("fail after publishing")
		}
		return nil, nil
	})

	fail = true
	in := message.NewMessage("order-1", nil)
	envelope.SetCorrelationID(in, "corr-9")
	_, err := h(in)
	require.Error(t, err)
	require.Equal(t, 0, e.s.Count(t, "message_id = $1", "invoice-for-order-1"))

	fail = false
	in = message.NewMessage("order-1", nil)
	envelope.SetCorrelationID(in, "corr-9")
	_, err = h(in)
	require.NoError(t, err)
	require.Equal(t, 1, e.applied(t, "order-1"))
	var causation, correlation, dest string
	require.NoError(t, e.db.QueryRow(`SELECT causation_id, correlation_id, destination FROM messaging_outbox WHERE message_id = $1`,
		"invoice-for-order-1").Scan(&causation, &correlation, &dest))
	require.Equal(t, "order-1", causation)
	require.Equal(t, "corr-9", correlation)
	require.Equal(t, "invoices", dest)
}

func TestFollowUpKeepsItsOwnCausation(t *testing.T) {
	e := newEnv(t)
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		follow := message.NewMessage("f-1", nil)
		envelope.SetCausationID(follow, "explicit")
		return nil, inbox.Publisher(msg.Context()).Publish("t", follow)
	})
	_, err := h(message.NewMessage("in-1", nil))
	require.NoError(t, err)
	require.Equal(t, 1, e.s.Count(t, "message_id = 'f-1' AND causation_id = 'explicit' AND correlation_id IS NULL"))
}

// Produced messages would be published by the router after the inbox record
// committed; if that publish failed, the redelivery would be skipped and they
// would be lost. The middleware refuses them and commits nothing.
func TestProducedMessagesAreRefusedAndNothingCommits(t *testing.T) {
	e := newEnv(t)
	h := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := effectHandler(msg); err != nil {
			return nil, err
		}
		follow := message.NewMessage("follow-"+msg.UUID, nil)
		if err := inbox.Publisher(msg.Context()).Publish("t", follow); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("produced", []byte("p"))}, nil
	})
	for range 2 { // the redelivery is refused again, not skipped as done
		produced, err := h(message.NewMessage("in-2", nil))
		require.ErrorIs(t, err, inbox.ErrProducedMessages)
		require.Equal(t, inbox.CodeProducedMessages, outbox.CodeOf(err))
		require.Empty(t, produced, "nothing is handed to the router to publish")
		require.Equal(t, 0, e.applied(t, "in-2"))
		require.Equal(t, 0, e.inboxRows(t, "billing", "in-2"))
		require.Equal(t, 0, e.s.Count(t, "message_id = $1", "follow-in-2"))
	}

	// An empty (non-nil) slice is not a produced message.
	empty := inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
		_, err := effectHandler(msg)
		return []*message.Message{}, err
	})
	_, err := empty(message.NewMessage("in-3", nil))
	require.NoError(t, err)
	require.Equal(t, 1, e.applied(t, "in-3"))
	require.Equal(t, 1, e.inboxRows(t, "billing", "in-3"))
}

func TestOutsideTheMiddlewareThereIsNoTransaction(t *testing.T) {
	require.Nil(t, inbox.Tx(context.Background()))
	require.Nil(t, inbox.Publisher(context.Background()))
}

func TestBadInputIsRefused(t *testing.T) {
	e := newEnv(t)
	for name, tc := range map[string]struct {
		db       *sql.DB
		consumer string
		cfg      inbox.Config
	}{
		"nil db":          {nil, "c", inbox.Config{}},
		"empty consumer":  {e.db, "", inbox.Config{}},
		"long consumer":   {e.db, string(make([]byte, inbox.MaxConsumerLength+1)), inbox.Config{}},
		"NUL in consumer": {e.db, "a\x00b", inbox.Config{}},
		"bad UTF-8":       {e.db, "\xff", inbox.Config{}},
		"bad publisher":   {e.db, "c", inbox.Config{Publisher: publisherWithNUL()}},
		"read-only tx":    {e.db, "c", inbox.Config{TxOptions: &sql.TxOptions{ReadOnly: true}}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := inbox.NewMiddleware(tc.db, tc.consumer, tc.cfg)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			called := false
			h := inbox.Middleware(tc.db, tc.consumer, tc.cfg)(func(*message.Message) ([]*message.Message, error) {
				called = true
				return nil, nil
			})
			_, err = h(message.NewMessage("m", nil))
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			require.False(t, called)
		})
	}

	h := inbox.Middleware(e.db, "billing", inbox.Config{})(effectHandler)
	_, err := h(message.NewMessage("", nil))
	require.ErrorIs(t, err, outbox.ErrMessageIDRequired)
	// An id the inbox's key cannot hold fails with a code, not with the
	// database's error on every redelivery; the longest allowed is recorded.
	_, err = h(message.NewMessage(strings.Repeat("i", inbox.MaxMessageIDLength+1), nil))
	require.ErrorIs(t, err, outbox.ErrMessageIDTooLong)
	_, err = h(message.NewMessage(strings.Repeat("i", inbox.MaxMessageIDLength), nil))
	require.NoError(t, err)
}

func TestRouterWithGoChannelDeduplicatesRedelivery(t *testing.T) {
	e := newEnv(t)
	logger := watermill.NopLogger{}
	// Publish returns only after the subscriber acked, so deliveries are
	// sequential and the test knows when each was handled.
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	mw, err := inbox.NewMiddleware(e.db, "router-consumer", inbox.Config{})
	require.NoError(t, err)
	handled := make(chan string, 10)
	router.AddConsumerHandler("h", "orders", ps, func(msg *message.Message) error {
		_, err := effectHandler(msg)
		handled <- msg.UUID
		return err
	})
	router.AddMiddleware(mw)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, ps.Close())
	}()
	<-router.Running()

	// The same message id delivered three times: a relay retry after an
	// ambiguous publish looks exactly like this.
	for range 3 {
		require.NoError(t, ps.Publish("orders", message.NewMessage("dup-1", []byte("x"))))
	}
	require.Equal(t, 1, e.applied(t, "dup-1"))
	require.Equal(t, "dup-1", <-handled)
	require.Empty(t, handled)
}
