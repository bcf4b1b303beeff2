package main

import (
	"cmp"
	"fmt"
	"os"

	"cloud.google.com/go/pubsub/v2/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/v2/pstest"
	"github.com/ThreeDotsLabs/watermill"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
)

// pubSub is where the relay publishes and the consumer subscribes.
type pubSub struct {
	project  string
	where    string
	server   *pstest.Server // nil unless in-process
	pubOpts  []option.ClientOption
	subOpts  []option.ClientOption
	cleanups []func()
}

// connectPubSub picks the Pub/Sub to use: an emulator (PUBSUB_EMULATOR_HOST,
// which the client library honours by itself), a real project
// (GOOGLE_CLOUD_PROJECT with application default credentials), or else the
// in-process pstest server.
func connectPubSub() (*pubSub, error) {
	project := cmp.Or(os.Getenv("GOOGLE_CLOUD_PROJECT"), "outbox-demo")
	if host := os.Getenv("PUBSUB_EMULATOR_HOST"); host != "" {
		return &pubSub{project: project, where: "the Pub/Sub emulator at " + host + " (PUBSUB_EMULATOR_HOST)"}, nil
	}
	if os.Getenv("GOOGLE_CLOUD_PROJECT") != "" {
		return &pubSub{project: project, where: "Google Cloud project " + project + " (GOOGLE_CLOUD_PROJECT)"}, nil
	}
	ps := &pubSub{project: project, where: "in-process Pub/Sub (pstest; set PUBSUB_EMULATOR_HOST or GOOGLE_CLOUD_PROJECT for a real one)"}
	ps.server = pstest.NewServer()
	ps.cleanups = append(ps.cleanups, func() { _ = ps.server.Close() })
	// Each client gets its own connection: closing a client closes it.
	for _, opts := range []*[]option.ClientOption{&ps.pubOpts, &ps.subOpts} {
		conn, err := grpc.NewClient(ps.server.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			ps.close()
			return nil, fmt.Errorf("dial pstest: %w", err)
		}
		ps.cleanups = append(ps.cleanups, func() { _ = conn.Close() })
		*opts = []option.ClientOption{option.WithGRPCConn(conn)}
	}
	return ps, nil
}

// publisher is what the relay hands rows to: the message UUID, the
// canonical metadata as attributes, msg.partition_key as the ordering key.
// Topics are not created on the fly (a typo would otherwise be a topic
// nobody reads); the subscriber below creates the demo's topic first.
func (ps *pubSub) publisher(logger watermill.LoggerAdapter) (*wgc.Publisher, error) {
	return googlecloud.NewPublisher(googlecloud.Config{
		ProjectID:             ps.project,
		EnableMessageOrdering: true,
		ClientOptions:         ps.pubOpts,
	}, logger)
}

// subscriber reads the shipping service's subscription, with message
// ordering so one customer's events arrive in the order they were committed.
func (ps *pubSub) subscriber(logger watermill.LoggerAdapter) (*wgc.Subscriber, error) {
	return wgc.NewSubscriber(wgc.SubscriberConfig{
		ProjectID:                ps.project,
		GenerateSubscriptionName: wgc.TopicSubscriptionNameWithSuffix("-shipping"),
		GenerateSubscription: func(wgc.GenerateSubscriptionParams) *pubsubpb.Subscription {
			return &pubsubpb.Subscription{EnableMessageOrdering: true, AckDeadlineSeconds: 10}
		},
		ClientOptions: ps.subOpts,
	}, logger)
}

func (ps *pubSub) close() {
	for i := len(ps.cleanups) - 1; i >= 0; i-- {
		ps.cleanups[i]()
	}
}
