package main

import (
	"testing"

	"cloud.google.com/go/pubsub/v2/pstest"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/stretchr/testify/require"
)

// TestRelayToPubSub runs the built relay against pstest, Google's in-memory
// Pub/Sub server, reached by the child process through PUBSUB_EMULATOR_HOST
// exactly as an emulator would be.
func TestRelayToPubSub(t *testing.T) {
	t.Parallel()
	srv := pstest.NewServer()
	t.Cleanup(func() { _ = srv.Close() })
	s := newSchema(t)
	testdb.InsertRows(t, s.DB,
		testdb.Row(envelope.Row{MessageID: "ps-1", Destination: "orders", Payload: []byte("one"), Headers: map[string]string{"app": "shop"}}),
		testdb.Row(envelope.Row{MessageID: "ps-2", Destination: "orders", Payload: []byte("two")}))

	cmd, stderr := startRelay(t, s, []string{"PUBSUB_EMULATOR_HOST=" + srv.Addr},
		"--to", "pubsub", "--pubsub-project", "outbox-test", "--pubsub-create-topics")

	await.Until(t, func() bool { return s.Count(t, "status = 'PUBLISHED'") == 2 }, "stderr:\n%s", stderr.String())
	got := map[string]string{}
	for _, m := range srv.Messages() {
		got[string(m.Data)] = m.Attributes["app"]
	}
	require.Equal(t, map[string]string{"one": "shop", "two": ""}, got)

	stopRelay(t, cmd, stderr)

	// Without a project the transport refuses: a usage error.
	r := db(t, s, "relay", "--to", "pubsub")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "ProjectID")
}
