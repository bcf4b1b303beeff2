package main

import (
	"strings"
	"testing"
	"time"

	wn "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest/natstest"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/transport/nats"
)

// TestRelayToNATS runs the built relay against a local NATS JetStream. The
// test creates the in-memory stream capturing the subject the relay
// publishes to and reads it back by sequence.
func TestRelayToNATS(t *testing.T) {
	t.Parallel()
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("outboxctl-orders")
	js := natstest.JetStream(t, u, subject, 0)

	s := newSchema(t)
	missing := brokertest.Unique("outboxctl-nostream")
	testdb.InsertRows(t, s.DB,
		testdb.Row(envelope.Row{MessageID: "n-1", Destination: subject, Payload: []byte("one"), Headers: map[string]string{"app": "shop"}}),
		testdb.Row(envelope.Row{MessageID: "n-2", Destination: subject, Payload: []byte("two")}),
		testdb.Row(envelope.Row{MessageID: "n-missing", Destination: missing, Payload: []byte("x")}))

	cmd, stderr := startRelay(t, s, nil, "--to", "nats", "--nats-url", u)
	waitStatus(t, s, stderr, "n-1", "PUBLISHED")
	waitStatus(t, s, stderr, "n-2", "PUBLISHED")
	// nats.Classify is the relay's classifier: a subject no stream captures
	// is the destination unavailable as a whole (a missing stream, or
	// JetStream down), not the message: the row waits PENDING without
	// spending attempts, and its destination's breaker opens.
	require.Eventually(t, func() bool {
		return s.Count(t, "message_id = 'n-missing' AND status = 'PENDING' AND last_failure_code = $1", nats.CodeNoStream) == 1
	}, 45*time.Second, 50*time.Millisecond, "row n-missing never put back as unavailable: %s\nstderr:\n%s", rowState(t, s, "n-missing"), stderr.String())
	require.Zero(t, s.Count(t, "message_id = 'n-missing' AND attempts > 0"), "an unavailable destination spends no attempt")

	info, err := js.StreamInfo(subject)
	require.NoError(t, err)
	require.Equal(t, uint64(2), info.State.Msgs)
	got := map[string]*natsgo.RawStreamMsg{}
	for seq := uint64(1); seq <= 2; seq++ {
		m, err := js.GetMsg(subject, seq)
		require.NoError(t, err)
		id := m.Header.Get(wn.WatermillUUIDHdr)
		require.Equal(t, id, m.Header.Get(natsgo.MsgIdHdr), "the UUID is the JetStream message id")
		got[id] = m
	}
	require.Equal(t, "one", string(got["n-1"].Data))
	require.Equal(t, "shop", got["n-1"].Header.Get("app"))
	require.Equal(t, "two", string(got["n-2"].Data))

	stopRelay(t, cmd, stderr)
}

// An empty or malformed --nats-url is a usage error, refused before any
// dial: OUTBOX_INVALID_CONFIG, exit 2, the URL (and its password) not shown.
func TestRelayToNATSBadURL(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	r := db(t, s, "relay", "--to", "nats", "--nats-url", "")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "code: OUTBOX_INVALID_CONFIG")
	require.Contains(t, r.stderr, "URL is required")

	for _, tc := range []struct{ url, detail string }{
		{"nats://u:pw-x9q%Z@127.0.0.1:4222", "server 1 does not parse"},
		{"nats://127.0.0.1:4222, nats://u:pw-x9q%Z@h:4222", "server 2 does not parse"},
		{"nats://127.0.0.1:notaport", "server 1 does not parse"},
		{"nats://", "server 1 does not parse"},
		{" , ", "lists no server"},
	} {
		r = db(t, s, "relay", "--to", "nats", "--nats-url", tc.url)
		requireCode(t, r, 2)
		require.Contains(t, r.stderr, "code: OUTBOX_INVALID_CONFIG", "url %q", tc.url)
		require.Contains(t, r.stderr, tc.detail, "url %q", tc.url)
		require.NotContains(t, r.stderr, "pw-x9q", "url %q", tc.url)
	}
}

// The help says what the code does (transport/nats.Classify): a subject no
// stream captures leaves the row PENDING, it is not parked FAILED.
func TestRelayHelpNATSMissingStream(t *testing.T) {
	t.Parallel()
	r := cli(t, nil, "relay", "--help")
	requireCode(t, r, 0)
	help := strings.Join(strings.Fields(r.stdout), " ")
	require.NotRegexp(t, `stream parks`, help)
	require.Contains(t, help, "A NATS subject no stream captures is unavailable, not a rejection: the row stays PENDING with no attempt spent")
	require.Regexp(t, `--nats-create-streams nats: create a stream for a subject no stream captures \(default: such a row stays PENDING, no attempt spent`, help)
	require.NotContains(t, help, "such a row is parked FAILED")
}
