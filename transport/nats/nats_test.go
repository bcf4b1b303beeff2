package nats_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wn "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/e2e"
	"github.com/fencedoutbox/watermill-outbox/transport/nats"
)

// serverURL returns the NATS URL, skipping the test when nothing answers.
func serverURL(t *testing.T) string {
	t.Helper()
	u := os.Getenv("OUTBOX_TEST_NATS_URL")
	if u == "" {
		u = "nats://127.0.0.1:4222"
	}
	parsed, err := url.Parse(u)
	require.NoError(t, err)
	c, err := net.DialTimeout("tcp", parsed.Host, time.Second)
	if err != nil {
		t.Skipf("NATS (JetStream) is not reachable at %s (set OUTBOX_TEST_NATS_URL or run `make services`): %v", parsed.Host, err)
	}
	_ = c.Close()
	return u
}

func unique(prefix string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}

// stream creates a stream capturing subject, deleted at cleanup.
func stream(t *testing.T, u, subject string, maxMsgSize int32) {
	t.Helper()
	nc, err := natsgo.Connect(u)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	require.NoError(t, err)
	_, err = js.AddStream(&natsgo.StreamConfig{Name: subject, Subjects: []string{subject}, MaxMsgSize: maxMsgSize, Storage: natsgo.MemoryStorage})
	if err != nil && errors.Is(err, natsgo.ErrJetStreamNotEnabled) {
		t.Skipf("NATS at %s has JetStream disabled (start nats-server with -js)", u)
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(subject) })
}

func newPublisher(t *testing.T, u string) *wn.Publisher {
	t.Helper()
	pub, err := nats.NewPublisher(nats.Config{URL: u}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func TestSubjectWithoutStreamIsRejected(t *testing.T) {
	u := serverURL(t)
	pub := newPublisher(t, u)
	err := pub.Publish(unique("nostream"), message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: nats.CodeNoStream}, nats.Classify(err), "error: %v", err)
}

func TestMessageOverStreamMaxMsgSizeIsRejected(t *testing.T) {
	u := serverURL(t)
	subject := unique("small")
	stream(t, u, subject, 256)
	pub := newPublisher(t, u)
	err := pub.Publish(subject, message.NewMessage("big", make([]byte, 1024)))
	require.Error(t, err)
	v := nats.Classify(err)
	require.Equal(t, forwarder.Rejected, v.Outcome, "error: %v", err)
	require.Equal(t, "NATS_JS_10054", v.Code, "error: %v", err) // JSStreamMessageExceedsMaximumErr
}

func TestPayloadOverServerMaxPayloadIsRejected(t *testing.T) {
	u := serverURL(t)
	subject := unique("huge")
	stream(t, u, subject, 0)
	nc, err := natsgo.Connect(u)
	require.NoError(t, err)
	limit := nc.MaxPayload() // announced by the server in INFO
	nc.Close()
	pub := newPublisher(t, u)
	err = pub.Publish(subject, message.NewMessage("huge", make([]byte, limit+1)))
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: nats.CodeMaxPayload}, nats.Classify(err), "error: %v", err)
}

func TestClassifyAmbiguous(t *testing.T) {
	require.Equal(t, forwarder.Confirmed, nats.Classify(nil).Outcome)
	for _, err := range []error{natsgo.ErrTimeout, natsgo.ErrDisconnected, natsgo.ErrConnectionClosed, context.DeadlineExceeded,
		&natsgo.APIError{Code: 503, ErrorCode: 10023, Description: "jetstream temporarily unavailable"}, errors.New("other")} {
		require.Equal(t, forwarder.Ambiguous, nats.Classify(err).Outcome, "%v", err)
	}
}

func TestClosedConnectionIsAmbiguous(t *testing.T) {
	u := serverURL(t)
	subject := unique("closed")
	stream(t, u, subject, 0)
	nc, err := natsgo.Connect(u)
	require.NoError(t, err)
	cfg := nats.Config{URL: u}.WatermillConfig()
	pub, err := wn.NewPublisherWithNatsConn(nc, cfg.GetPublisherPublishConfig(), nil)
	require.NoError(t, err)
	nc.Close()
	err = pub.Publish(subject, message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	require.Equal(t, forwarder.Ambiguous, nats.Classify(err).Outcome, "error: %v", err)
}

func TestConfigValidation(t *testing.T) {
	_, err := nats.NewPublisher(nats.Config{}, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

func TestEndToEnd(t *testing.T) {
	u := serverURL(t)
	subject := unique("orders")
	stream(t, u, subject, 0)
	sub, err := wn.NewSubscriber(wn.SubscriberConfig{
		URL:              u,
		SubscribersCount: 1,
		AckWaitTimeout:   30 * time.Second,
		CloseTimeout:     10 * time.Second,
		Unmarshaler:      &wn.NATSMarshaler{},
		JetStream: wn.JetStreamConfig{
			SubscribeOptions: []natsgo.SubOpt{natsgo.DeliverAll(), natsgo.AckExplicit()},
		},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	received, err := sub.Subscribe(ctx, subject)
	require.NoError(t, err)

	pub := newPublisher(t, u)
	e2e.Relay(t, subject, pub, nats.Classify)
	e2e.Check(t, e2e.Receive(t, received, len(e2e.Messages()), 20*time.Second))
}
