package nats_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wn "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest/natstest"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/e2e"
	"github.com/fencedoutbox/watermill-outbox/transport/nats"
)

func newPublisher(t *testing.T, u string) *wn.Publisher {
	t.Helper()
	pub, err := nats.NewPublisher(nats.Config{URL: u}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// No stream answers for the subject: JetStream never saw the message, and
// the cause (a missing stream, JetStream down) is the destination's, not the
// message's: unavailable, no attempt spent.
func TestSubjectWithoutStreamIsUnavailable(t *testing.T) {
	u := brokertest.NATSURL(t)
	pub := newPublisher(t, u)
	err := pub.Publish(brokertest.Unique("nostream"), message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Unavailable, Code: nats.CodeNoStream}, nats.Classify(err), "error: %v", err)
}

func TestMessageOverStreamMaxMsgSizeIsRejected(t *testing.T) {
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("small")
	natstest.JetStream(t, u, subject, 256)
	pub := newPublisher(t, u)
	err := pub.Publish(subject, message.NewMessage("big", make([]byte, 1024)))
	require.Error(t, err)
	v := nats.Classify(err)
	require.Equal(t, forwarder.Rejected, v.Outcome, "error: %v", err)
	require.Equal(t, "NATS_JS_10054", v.Code, "error: %v", err) // JSStreamMessageExceedsMaximumErr
}

func TestPayloadOverServerMaxPayloadIsRejected(t *testing.T) {
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("huge")
	natstest.JetStream(t, u, subject, 0)
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
	for _, err := range []error{natsgo.ErrTimeout, natsgo.ErrDisconnected, context.DeadlineExceeded,
		&natsgo.APIError{Code: 503, ErrorCode: 10023, Description: "jetstream temporarily unavailable"}, errors.New("other")} {
		require.Equal(t, forwarder.Ambiguous, nats.Classify(err).Outcome, "%v", err)
	}
}

// A closed connection sends nothing: the destination is unavailable, the
// message spends no attempt.
func TestClosedConnectionIsUnavailable(t *testing.T) {
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("closed")
	natstest.JetStream(t, u, subject, 0)
	nc, err := natsgo.Connect(u)
	require.NoError(t, err)
	cfg := nats.Config{URL: u}.WatermillConfig()
	pub, err := wn.NewPublisherWithNatsConn(nc, cfg.GetPublisherPublishConfig(), nil)
	require.NoError(t, err)
	nc.Close()
	err = pub.Publish(subject, message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	require.Equal(t, forwarder.Unavailable, nats.Classify(err).Outcome, "error: %v", err)
}

func TestConfigValidation(t *testing.T) {
	_, err := nats.NewPublisher(nats.Config{}, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

func TestEndToEnd(t *testing.T) {
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("orders")
	natstest.JetStream(t, u, subject, 0)
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

func TestRetryInsideDuplicateWindowIsStoredOnce(t *testing.T) {
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("dedup")
	js := natstest.JetStream(t, u, subject, 0)
	pub := newPublisher(t, u)
	// A relay retry republishes the same row: same UUID, same payload.
	require.NoError(t, pub.Publish(subject, message.NewMessage("retried", []byte("x"))))
	require.NoError(t, pub.Publish(subject, message.NewMessage("retried", []byte("x"))))
	info, err := js.StreamInfo(subject)
	require.NoError(t, err)
	require.Equal(t, uint64(1), info.State.Msgs)

	// Another UUID is another message: the stream does store repeats of a
	// payload, it is the message id that de-duplicates.
	require.NoError(t, pub.Publish(subject, message.NewMessage("other", []byte("x"))))
	info, err = js.StreamInfo(subject)
	require.NoError(t, err)
	require.Equal(t, uint64(2), info.State.Msgs)
}

// transport/nats/doc.go: with Config.AutoProvision a subject that no stream
// captures gets a stream on the real server, and the publish is stored
// (without it the same publish is refused: TestSubjectWithoutStreamIsRejected).
func TestAutoProvisionCreatesTheStream(t *testing.T) {
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("auto")
	pub, err := nats.NewPublisher(nats.Config{URL: u, AutoProvision: true}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	nc, err := natsgo.Connect(u)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(subject) })

	require.NoError(t, pub.Publish(subject, message.NewMessage("m1", []byte("x"))))
	info, err := js.StreamInfo(subject)
	require.NoError(t, err)
	require.Equal(t, uint64(1), info.State.Msgs)
}
