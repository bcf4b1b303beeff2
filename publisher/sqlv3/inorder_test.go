package sqlv3_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher/sqlv3"
)

// TestWatermillSQLv3InOrderThroughTheOutbox runs watermill's own
// TestPublishSubscribeInOrder (the test watermill-sql v3.1.0 runs for its
// PostgreSQL Pub/Sub, with the same features) with the drop-in in between: the
// test publishes 1000 messages on one topic through watermill-sql's publisher
// with sqlv3.Schema{} into messaging_outbox, a forwarder at its default
// configuration (forwarder.Config{}: Concurrency 8) relays them into
// watermill-sql's own table, and ten watermill-sql subscribers of one
// consumer group read them. The test requires each of the 16 message types
// (every 16th message) to arrive in publishing order.
//
// It passes because the adapter keys unkeyed messages by their topic
// (publisher.Config.KeyUnkeyedByTopic). With sqlv3.Schema{UnorderedTopics:
// true} it fails: the forwarder publishes the unkeyed rows up to 8 at a time
// and watermill-sql's table then holds neighbours swapped ("Not equal ...
// Diff" on the ids of a type).
func TestWatermillSQLv3InOrderThroughTheOutbox(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(20)
	logger := watermill.NopLogger{}

	// watermill-sql's own tables, as its pubsub tests name them.
	downstream := &wsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(topic string) string { return fmt.Sprintf(`"test_%s"`, topic) },
		GeneratePayloadType:       func(string) string { return "BYTEA" },
	}
	offsets := wsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(topic string) string { return fmt.Sprintf(`"test_offsets_%s"`, topic) },
	}
	out, err := wsql.NewPublisher(s.DB, wsql.PublisherConfig{SchemaAdapter: downstream, AutoInitializeSchema: true}, logger)
	require.NoError(t, err)

	// One relay for the whole test (the constructor below is called eleven
	// times: once for the publisher, then once per subscriber).
	relay, err := forwarder.New(s.DB, out, logger, forwarder.Config{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = relay.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, relay.Close())
		wg.Wait()
		require.NoError(t, out.Close())
	})
	select {
	case <-relay.Running():
	case <-time.After(time.Minute):
		t.Fatal("the forwarder did not start")
	}

	constructor := func(t *testing.T) (message.Publisher, message.Subscriber) {
		pub, err := wsql.NewPublisher(s.DB, wsql.PublisherConfig{SchemaAdapter: sqlv3.Schema{}}, logger)
		require.NoError(t, err)
		sub, err := wsql.NewSubscriber(s.DB, wsql.SubscriberConfig{
			ConsumerGroup:  "test",
			PollInterval:   time.Millisecond,
			ResendInterval: 5 * time.Millisecond,
			SchemaAdapter:  downstream,
			OffsetsAdapter: offsets,
		}, logger)
		require.NoError(t, err)
		return pub, sub
	}

	tests.TestPublishSubscribeInOrder(t, tests.TestContext{
		TestID: tests.NewTestID(),
		// watermill-sql v3.1.0's TestPostgreSQLPublishSubscribe features (v3.1.0's).
		Features: tests.Features{
			ConsumerGroups:      true,
			ExactlyOnceDelivery: true,
			GuaranteedOrder:     true,
			Persistent:          true,
		},
	}, constructor)
}
