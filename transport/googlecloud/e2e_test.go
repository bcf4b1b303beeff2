package googlecloud_test

import (
	"context"
	"testing"
	"time"

	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/e2e"
)

func TestEndToEnd(t *testing.T) {
	srv := fakePubSub(t)
	createTopic(t, srv, "orders")
	sub, err := wgc.NewSubscriber(wgc.SubscriberConfig{
		ProjectID:                project,
		ClientOptions:            dial(t, srv),
		GenerateSubscriptionName: func(topic string) string { return topic + "-e2e" },
	}, nil)
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	received, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	pub := newPublisher(t, srv, googlecloud.Config{EnableMessageOrdering: true})
	e2e.Relay(t, "orders", pub, googlecloud.Classify)
	e2e.Check(t, e2e.Receive(t, received, len(e2e.Messages()), 20*time.Second))

	// The broker holds exactly the committed messages, the rolled-back one
	// never; the partition key travelled as the ordering key.
	msgs := srv.Messages()
	require.Len(t, msgs, len(e2e.Messages()))
	for _, m := range msgs {
		require.NotEqual(t, e2e.RolledBackID, m.Attributes[wgc.UUIDHeaderKey])
		require.Equal(t, m.Attributes["msg.partition_key"], m.OrderingKey)
	}
}
