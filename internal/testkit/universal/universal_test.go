package universal_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// Features that are honestly true of "outbox publisher + forwarder + broker":
//
//   - Persistent: true. A Publish that returned is a committed row; the
//     forwarder delivers it whether or not anyone subscribes yet, and the
//     downstream keeps it (persistent GoChannel, like a durable topic).
//   - NewSubscriberReceivesOldMessages: true, because the downstream replays
//     its topic to new subscribers (a property of the broker, not of the
//     outbox).
//   - ExactlyOnceDelivery: false. The product promises at least once; a
//     publish whose confirm is lost is retried under the same id. Effectively
//     once needs the inbox on the consumer side.
//   - GuaranteedOrder: false. Order is guaranteed per ordering key
//     (msg.ordering_key), and the suite publishes without one; rows without a
//     key are published concurrently (Config.Concurrency), so the suite's
//     whole-topic order checks do not apply (TestPublishSubscribeInOrder and
//     TestResendOnError skip themselves).
//   - ConsumerGroups: false. Consumer groups belong to the broker; GoChannel
//     has none (TestConsumerGroups skips).
//   - ContextPreserved: false. The message crosses a database row: context
//     values of the publishing goroutine cannot survive that (the trace
//     context does, as columns).
//   - RequireSingleInstance: true. Every constructor call shares one outbox
//     schema and one broker (they model clients of the same database and
//     broker), so messages published through one pair are received through
//     another, as TestConcurrentClose requires.
//   - RestartServiceCommand: none (TestReconnect skips); restarts of the
//     database and the relay are the chaos soak's job (internal/testkit/chaos).
//   - ForceShort: true, to keep the suite within about a minute on a shared
//     machine.
var features = tests.Features{
	ConsumerGroups:                   false,
	ExactlyOnceDelivery:              false,
	GuaranteedOrder:                  false,
	Persistent:                       true,
	NewSubscriberReceivesOldMessages: true,
	RequireSingleInstance:            true,
	ContextPreserved:                 false,
	ForceShort:                       true,
}

// TestPubSub runs every test of tests.TestPubSub except one, each with the
// same Features; it lists them itself (instead of calling tests.TestPubSub)
// only so that TestConcurrentSubscribeMultipleTopics can be replaced by
// TestSameMessageOnSeveralTopicsIsRefused: that test publishes the very same
// message objects (same msg.UUID) to twenty topics, and the outbox stores
// one row per message id (messaging_outbox.message_id is the primary key),
// so the second topic is refused with OUTBOX_DUPLICATE_MESSAGE_ID. That is
// the product's contract, not a bug: copy the message with a new UUID per
// topic. The remaining tests skip themselves according to Features:
// TestPublishSubscribeInOrder and TestResendOnError (GuaranteedOrder),
// TestReconnect (no RestartServiceCommand), TestConsumerGroups.
func TestPubSub(t *testing.T) {
	env := newEnvironment(t)
	t.Cleanup(func() { env.assertDrained(t) })
	suite := []struct {
		name     string
		fn       func(*testing.T, tests.TestContext, tests.PubSubConstructor)
		parallel bool
	}{
		{"TestPublishSubscribe", tests.TestPublishSubscribe, true},
		{"TestConcurrentSubscribe", tests.TestConcurrentSubscribe, true},
		{"TestResendOnError", tests.TestResendOnError, true},
		{"TestNoAck", tests.TestNoAck, true},
		{"TestContinueAfterSubscribeClose", tests.TestContinueAfterSubscribeClose, true},
		{"TestConcurrentClose", tests.TestConcurrentClose, true},
		{"TestContinueAfterErrors", tests.TestContinueAfterErrors, true},
		{"TestPublishSubscribeInOrder", tests.TestPublishSubscribeInOrder, true},
		{"TestPublisherClose", tests.TestPublisherClose, true},
		{"TestTopic", tests.TestTopic, true},
		{"TestMessageCtx", tests.TestMessageCtx, true},
		{"TestSubscribeCtx", tests.TestSubscribeCtx, true},
		{"TestNewSubscriberReceivesOldMessages", tests.TestNewSubscriberReceivesOldMessages, true},
		{"TestReconnect", tests.TestReconnect, false},
	}
	for _, tc := range suite {
		t.Run(tc.name, func(t *testing.T) {
			if tc.parallel {
				t.Parallel()
			}
			tc.fn(t, tests.TestContext{TestID: tests.NewTestID(), Features: features}, env.constructor)
		})
	}
	t.Run("TestConsumerGroups", func(t *testing.T) {
		tests.TestConsumerGroups(t, tests.TestContext{TestID: tests.NewTestID(), Features: features}, nil)
	})
	t.Run("TestSameMessageOnSeveralTopicsIsRefused", func(t *testing.T) {
		pub, sub := env.constructor(t)
		defer func() { require.NoError(t, pub.Close()); require.NoError(t, sub.Close()) }()
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		require.NoError(t, pub.Publish("topic-a-"+msg.UUID, msg))
		err := pub.Publish("topic-b-"+msg.UUID, msg)
		require.ErrorIs(t, err, outbox.ErrDuplicateMessageID)
		copied := msg.Copy()
		copied.UUID = watermill.NewUUID()
		require.NoError(t, pub.Publish("topic-b-"+msg.UUID, copied), "a copy under a new id is the supported way")
	})
}

// environment is the shared infrastructure: one outbox schema, one relay,
// one broker.
type environment struct {
	schema *testdb.Schema
	db     *sql.DB
	broker *gochannel.GoChannel
	relay  *forwarder.Forwarder
}

func newEnvironment(t *testing.T) *environment {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(8)
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 256}, watermill.NopLogger{})
	relay, err := forwarder.New(s.DB, broker, watermill.NopLogger{}, forwarder.Config{
		BatchSize:       200,
		Concurrency:     8,
		PollInterval:    20 * time.Millisecond,
		MaxPollInterval: 200 * time.Millisecond,
		ListenURL:       s.URL,
		Owner:           "universal-relay",
	})
	require.NoError(t, err)
	runErr := make(chan error, 1)
	go func() { runErr <- relay.Run(context.Background()) }()
	select {
	case <-relay.Running():
	case err := <-runErr:
		t.Fatalf("relay did not start: %v", err)
	}
	// Cleanups run last-in first-out: the relay stops (draining) before the
	// broker closes and before testdb drops the schema.
	t.Cleanup(func() {
		require.NoError(t, relay.Close())
		require.NoError(t, <-runErr)
		require.NoError(t, broker.Close())
	})
	return &environment{schema: s, db: s.DB, broker: broker, relay: relay}
}

func (e *environment) constructor(t *testing.T) (message.Publisher, message.Subscriber) {
	ctx, cancel := context.WithCancel(context.Background())
	return &txPublisher{db: e.db}, &client{broker: e.broker, ctx: ctx, cancel: cancel}
}

// assertDrained checks the relay's side of the contract after the suite:
// every committed row was published and nothing is left in flight or parked.
func (e *environment) assertDrained(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		return e.schema.Count(t, "status <> 'PUBLISHED'") == 0
	}, 30*time.Second, 50*time.Millisecond, "rows not published: %d", e.schema.Count(t, "status <> 'PUBLISHED'"))
	require.Positive(t, e.schema.Count(t, ""), "the suite wrote no rows through the outbox")
}

// txPublisher is what a service does: each Publish is its own committed
// transaction (publisher.InTx).
type txPublisher struct {
	db     *sql.DB
	mu     sync.Mutex
	closed bool
}

func (p *txPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return outbox.Errorf(outbox.CodePublisherClosed, "universal.Publish", "publisher is closed")
	}
	ctx := context.Background()
	if len(msgs) > 0 {
		ctx = msgs[0].Context()
	}
	return publisher.InTx(ctx, p.db, publisher.Config{Notify: true}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish(topic, msgs...)
	})
}

func (p *txPublisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return nil
}

// client is one consumer connection to the shared broker: closing it ends
// its own subscriptions only, as closing a broker client does.
type client struct {
	broker *gochannel.GoChannel
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func (c *client) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	merged, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(c.ctx, cancel)
	in, err := c.broker.Subscribe(merged, topic)
	if err != nil {
		stop()
		cancel()
		return nil, err
	}
	// The suite expects the channel to be closed when Close returns, and
	// GoChannel closes its own asynchronously: forward through a channel
	// this client closes itself, and make Close wait for it.
	out := make(chan *message.Message)
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(out)
		defer stop()
		defer cancel()
		for {
			select {
			case <-merged.Done():
				return
			case msg, ok := <-in:
				if !ok {
					return
				}
				select {
				case out <- msg:
				case <-merged.Done():
					return
				}
			}
		}
	}()
	return out, nil
}

func (c *client) Close() error {
	c.cancel()
	c.wg.Wait()
	return nil
}
