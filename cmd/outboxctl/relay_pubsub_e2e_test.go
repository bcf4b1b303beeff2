package main

import (
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/v2/pstest"
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
	exec1(t, s.DB, `
INSERT INTO messaging_outbox (message_id, destination, payload, headers)
VALUES ('ps-1', 'orders', 'one', '{"app":"shop"}'), ('ps-2', 'orders', 'two', '{}')`)

	cmd := exec.Command(binary, "--database-url", s.URL, "relay", "--to", "pubsub", "--pubsub-project", "outbox-test",
		"--pubsub-create-topics", "--poll-interval", "50ms", "--max-poll-interval", "200ms")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "PUBSUB_EMULATOR_HOST=" + srv.Addr}
	var stderr syncWriter
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	require.Eventually(t, func() bool { return s.Count(t, "status = 'PUBLISHED'") == 2 }, 30*time.Second, 50*time.Millisecond,
		"stderr:\n%s", stderr.String())
	got := map[string]string{}
	for _, m := range srv.Messages() {
		got[string(m.Data)] = m.Attributes["app"]
	}
	require.Equal(t, map[string]string{"one": "shop", "two": ""}, got)

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), "stderr:\n%s", stderr.String())

	// Without a project the transport refuses: a usage error.
	r := db(t, s, "relay", "--to", "pubsub")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "ProjectID")
}

// syncWriter is an io.Writer the test can read while the child writes.
type syncWriter struct{ b syncBuffer }

func (w *syncWriter) Write(p []byte) (int, error) { w.b.WriteString(string(p)); return len(p), nil }
func (w *syncWriter) String() string              { return w.b.String() }
