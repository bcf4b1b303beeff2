package googlecloud_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"cloud.google.com/go/pubsub/v2/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/v2/pstest"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
)

const project = "outbox-test"

// fakePubSub starts the in-process Pub/Sub server, closed at cleanup.
func fakePubSub(t *testing.T, opts ...pstest.ServerReactorOption) *pstest.Server {
	t.Helper()
	srv := pstest.NewServer(opts...)
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// dial returns client options with a new gRPC connection to srv. Each client
// needs its own: closing a pubsub client closes the connection it was given.
func dial(t *testing.T, srv *pstest.Server) []option.ClientOption {
	t.Helper()
	conn, err := grpc.NewClient(srv.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return []option.ClientOption{option.WithGRPCConn(conn)}
}

func createTopic(t *testing.T, srv *pstest.Server, topic string) {
	t.Helper()
	ctx := context.Background()
	client, err := pubsub.NewClient(ctx, project, dial(t, srv)...)
	require.NoError(t, err)
	defer client.Close()
	_, err = client.TopicAdminClient.CreateTopic(ctx, &pubsubpb.Topic{Name: "projects/" + project + "/topics/" + topic})
	require.NoError(t, err)
}

func newPublisher(t *testing.T, srv *pstest.Server, cfg googlecloud.Config) *wgc.Publisher {
	t.Helper()
	cfg.ProjectID = project
	cfg.ClientOptions = dial(t, srv)
	pub, err := googlecloud.NewPublisher(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func TestPublishKeepsUUIDMetadataAndOrderingKey(t *testing.T) {
	srv := fakePubSub(t)
	createTopic(t, srv, "orders")
	pub := newPublisher(t, srv, googlecloud.Config{EnableMessageOrdering: true})

	keyed := message.NewMessage("01J-keyed", []byte(`{"order":1}`))
	envelope.SetPartitionKey(keyed, "customer-7")
	envelope.SetMessageType(keyed, "OrderPlaced")
	keyed.Metadata.Set("app-header", `ends with a backslash \`)
	unkeyed := message.NewMessage("01J-unkeyed", []byte("raw"))
	require.NoError(t, pub.Publish("orders", keyed, unkeyed))

	msgs := srv.Messages()
	require.Len(t, msgs, 2)
	byUUID := map[string]*pstest.Message{}
	for _, m := range msgs {
		byUUID[m.Attributes[wgc.UUIDHeaderKey]] = m
	}
	got := byUUID["01J-keyed"]
	require.NotNil(t, got)
	require.Equal(t, []byte(`{"order":1}`), got.Data)
	require.Equal(t, "customer-7", got.OrderingKey)
	require.Equal(t, "customer-7", got.Attributes[envelope.KeyPartitionKey])
	require.Equal(t, "OrderPlaced", got.Attributes[envelope.KeyMessageType])
	require.Equal(t, `ends with a backslash \`, got.Attributes["app-header"])
	require.NotNil(t, byUUID["01J-unkeyed"])
	require.Empty(t, byUUID["01J-unkeyed"].OrderingKey)
}

func TestOrderingKeyOnlyWhenOrderingEnabled(t *testing.T) {
	srv := fakePubSub(t)
	createTopic(t, srv, "orders")
	pub := newPublisher(t, srv, googlecloud.Config{})
	msg := message.NewMessage("m1", []byte("x"))
	envelope.SetPartitionKey(msg, "customer-7")
	require.NoError(t, pub.Publish("orders", msg))
	msgs := srv.Messages()
	require.Len(t, msgs, 1)
	require.Empty(t, msgs[0].OrderingKey)
	require.Equal(t, "customer-7", msgs[0].Attributes[envelope.KeyPartitionKey])
}

func TestMissingTopicIsRejected(t *testing.T) {
	srv := fakePubSub(t)
	pub := newPublisher(t, srv, googlecloud.Config{})
	err := pub.Publish("no-such-topic", message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	v := googlecloud.Classify(err)
	require.Equal(t, forwarder.Rejected, v.Outcome, "error: %v", err)
	require.Equal(t, googlecloud.CodeTopicNotFound, v.Code)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: googlecloud.CodeTopicNotFound}, googlecloud.Classify(err))
}

func TestMissingTopicWithoutExistenceCheckIsRejectedByServer(t *testing.T) {
	// Skip the client's existence check so the publish itself reaches pstest
	// and the server answers NOT_FOUND.
	srv := fakePubSub(t)
	cfg := googlecloud.Config{ProjectID: project, ClientOptions: dial(t, srv)}
	wcfg := cfg.WatermillConfig()
	wcfg.DoNotCheckTopicExistence = true
	pub, err := wgc.NewPublisher(wcfg, nil)
	require.NoError(t, err)
	defer pub.Close()

	err = pub.Publish("no-such-topic", message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	v := googlecloud.Classify(err)
	require.Equal(t, forwarder.Rejected, v.Outcome, "error: %v", err)
	require.Equal(t, "PUBSUB_NOT_FOUND", v.Code)
}

func TestCreateMissingTopics(t *testing.T) {
	srv := fakePubSub(t)
	pub := newPublisher(t, srv, googlecloud.Config{CreateMissingTopics: true})
	require.NoError(t, pub.Publish("fresh", message.NewMessage("m1", []byte("x"))))
	require.Len(t, srv.Messages(), 1)
}

func TestOversizedMessageIsRejected(t *testing.T) {
	// pstest accepts any size; the client library refuses requests over
	// pubsub.MaxPublishRequestBytes before sending, as it would against the
	// real service.
	srv := fakePubSub(t)
	createTopic(t, srv, "orders")
	pub := newPublisher(t, srv, googlecloud.Config{})
	err := pub.Publish("orders", message.NewMessage("big", make([]byte, pubsub.MaxPublishRequestBytes+1)))
	require.Error(t, err)
	v := googlecloud.Classify(err)
	require.Equal(t, forwarder.Rejected, v.Outcome, "error: %v", err)
	require.Equal(t, googlecloud.CodeMessageTooLarge, v.Code)
}

func TestServerErrorsClassify(t *testing.T) {
	cases := []struct {
		code codes.Code
		want forwarder.Outcome
		name string
	}{
		{codes.PermissionDenied, forwarder.Rejected, "PUBSUB_PERMISSION_DENIED"},
		{codes.InvalidArgument, forwarder.Rejected, "PUBSUB_INVALID_ARGUMENT"},
		{codes.FailedPrecondition, forwarder.Rejected, "PUBSUB_FAILED_PRECONDITION"},
		{codes.Internal, forwarder.Ambiguous, ""},
		{codes.Unavailable, forwarder.Ambiguous, ""},
	}
	for _, tc := range cases {
		t.Run(tc.code.String(), func(t *testing.T) {
			srv := fakePubSub(t, pstest.WithErrorInjection("Publish", tc.code, "injected by the test"))
			createTopic(t, srv, "orders")
			// Retryable codes are retried by the client until the publish
			// deadline; keep it short.
			pub := newPublisher(t, srv, googlecloud.Config{PublishTimeout: 300 * time.Millisecond})
			err := pub.Publish("orders", message.NewMessage("m1", []byte("x")))
			require.Error(t, err)
			v := googlecloud.Classify(err)
			require.Equal(t, tc.want, v.Outcome, "error: %v", err)
			if tc.name != "" {
				require.Equal(t, tc.name, v.Code)
			}
			require.NotEmpty(t, v.Code)
		})
	}
}

func TestReservedUUIDAttributeIsRefused(t *testing.T) {
	srv := fakePubSub(t)
	createTopic(t, srv, "orders")
	pub := newPublisher(t, srv, googlecloud.Config{})
	msg := message.NewMessage("m1", []byte("x"))
	msg.Metadata.Set(wgc.UUIDHeaderKey, "forged")
	err := pub.Publish("orders", msg)
	require.ErrorIs(t, err, googlecloud.ErrReservedAttribute)
	v := googlecloud.Classify(err)
	require.Equal(t, forwarder.Rejected, v.Outcome)
	require.Equal(t, string(googlecloud.CodeReservedAttribute), v.Code)
}

func TestEmptyReservedUUIDAttributeIsRefused(t *testing.T) {
	// Present but empty would otherwise overwrite the UUID attribute with "".
	msg := message.NewMessage("m1", []byte("x"))
	msg.Metadata.Set(wgc.UUIDHeaderKey, "")
	_, err := googlecloud.Marshaler{}.Marshal("orders", msg)
	require.ErrorIs(t, err, googlecloud.ErrReservedAttribute)
}

func TestClassifyLocalErrors(t *testing.T) {
	require.Equal(t, forwarder.Confirmed, googlecloud.Classify(nil).Outcome)
	require.Equal(t, forwarder.Confirmed, googlecloud.Classify(nil).Outcome)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: "CONTEXT_DEADLINE_EXCEEDED"}, googlecloud.Classify(context.DeadlineExceeded))
	for _, err := range []error{context.DeadlineExceeded, context.Canceled, errors.New("connection reset"),
		pubsub.ErrPublishingPaused{OrderingKey: "k"}} {
		require.Equal(t, forwarder.Ambiguous, googlecloud.Classify(err).Outcome, "%v", err)
	}
}

func TestConfigValidation(t *testing.T) {
	_, err := googlecloud.NewPublisher(googlecloud.Config{}, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.True(t, strings.Contains(err.Error(), "ProjectID"))
	_, err = googlecloud.NewPublisher(googlecloud.Config{ProjectID: "p", PublishTimeout: -time.Second}, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

func TestRoundTripThroughWatermillSubscriber(t *testing.T) {
	srv := fakePubSub(t)
	createTopic(t, srv, "orders")
	sub, err := wgc.NewSubscriber(wgc.SubscriberConfig{
		ProjectID:                project,
		ClientOptions:            dial(t, srv),
		Unmarshaler:              googlecloud.Marshaler{},
		GenerateSubscriptionName: func(topic string) string { return topic + "-consumer" },
	}, nil)
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	received, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	pub := newPublisher(t, srv, googlecloud.Config{EnableMessageOrdering: true})
	msg := message.NewMessage("01J-roundtrip", []byte("payload"))
	envelope.SetPartitionKey(msg, "k1")
	envelope.SetCorrelationID(msg, "corr-1")
	msg.Metadata.Set("h", "v")
	require.NoError(t, pub.Publish("orders", msg))

	select {
	case got := <-received:
		require.Equal(t, "01J-roundtrip", got.UUID)
		require.Equal(t, []byte("payload"), []byte(got.Payload))
		require.Equal(t, "k1", got.Metadata.Get(envelope.KeyPartitionKey))
		require.Equal(t, "corr-1", got.Metadata.Get(envelope.KeyCorrelationID))
		require.Equal(t, "v", got.Metadata.Get("h"))
		got.Ack()
	case <-ctx.Done():
		t.Fatal("message not received")
	}
}

// failFirst fails the first call of the function it is installed on with
// code, then lets every later call through to the fake server.
type failFirst struct {
	code  codes.Code
	fired atomic.Bool
}

func (f *failFirst) React(any) (bool, any, error) {
	if f.fired.CompareAndSwap(false, true) {
		return true, nil, status.Error(f.code, "injected once by the test")
	}
	return false, nil, nil
}

func TestFailedPublishResumesItsOrderingKey(t *testing.T) {
	keyed := func(id string) *message.Message {
		msg := message.NewMessage(id, []byte("x"))
		envelope.SetPartitionKey(msg, "customer-7")
		return msg
	}
	t.Run("resumed", func(t *testing.T) {
		srv := fakePubSub(t, pstest.ServerReactorOption{FuncName: "Publish", Reactor: &failFirst{code: codes.PermissionDenied}})
		createTopic(t, srv, "orders")
		pub := newPublisher(t, srv, googlecloud.Config{EnableMessageOrdering: true})
		require.Error(t, pub.Publish("orders", keyed("m1")))
		// The forwarder's retry of the row uses the same key: it goes through.
		require.NoError(t, pub.Publish("orders", keyed("m1")))
		msgs := srv.Messages()
		require.Len(t, msgs, 1)
		require.Equal(t, "customer-7", msgs[0].OrderingKey)
	})
	t.Run("without auto-resume the key stays paused", func(t *testing.T) {
		// The contrast that shows what the setting buys.
		srv := fakePubSub(t, pstest.ServerReactorOption{FuncName: "Publish", Reactor: &failFirst{code: codes.PermissionDenied}})
		createTopic(t, srv, "orders")
		cfg := googlecloud.Config{ProjectID: project, EnableMessageOrdering: true, ClientOptions: dial(t, srv)}.WatermillConfig()
		cfg.EnableMessageOrderingAutoResumePublishOnError = false
		pub, err := wgc.NewPublisher(cfg, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = pub.Close() })
		require.Error(t, pub.Publish("orders", keyed("m1")))
		err = pub.Publish("orders", keyed("m1"))
		require.ErrorAs(t, err, &pubsub.ErrPublishingPaused{})
		require.Empty(t, srv.Messages())
	})
}
