package main

import (
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Helpers of the relay end-to-end tests (log, Pub/Sub, Kafka, AMQP, NATS).

// startRelay runs `outboxctl relay` against s with args and a fast poll, its
// stderr collected for failure messages. The child's environment is PATH and
// HOME plus env ("KEY=value", e.g. an emulator address). The process is
// killed at cleanup if the test did not stop it.
func startRelay(t *testing.T, s *testdb.Schema, env []string, args ...string) (*exec.Cmd, *syncWriter) {
	t.Helper()
	all := append([]string{"--database-url", s.URL, "relay", "--poll-interval", "50ms", "--max-poll-interval", "200ms"}, args...)
	cmd := exec.Command(binary, all...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	stderr := &syncWriter{}
	cmd.Stderr = stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return cmd, stderr
}

// stopRelay sends SIGTERM and requires a clean exit 0 after the drain.
func stopRelay(t *testing.T, cmd *exec.Cmd, stderr *syncWriter) {
	t.Helper()
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), "stderr:\n%s", stderr.String())
	require.Contains(t, stderr.String(), "stopped")
}

// waitStatus waits until the row has status; on timeout it prints the row's
// failure and the relay's stderr.
func waitStatus(t *testing.T, s *testdb.Schema, stderr *syncWriter, id, status string) {
	t.Helper()
	require.Eventually(t, func() bool { return s.Count(t, "message_id = $1 AND status = $2", id, status) == 1 },
		45*time.Second, 50*time.Millisecond, "row %s never became %s: %s\nstderr:\n%s", id, status, rowState(t, s, id), stderr.String())
}

func rowState(t *testing.T, s *testdb.Schema, id string) string {
	var st, code, detail *string
	err := s.DB.QueryRow(`SELECT status, last_failure_code, last_failure_detail FROM messaging_outbox WHERE message_id = $1`, id).
		Scan(&st, &code, &detail)
	if err != nil {
		return err.Error()
	}
	deref := func(p *string) string {
		if p == nil {
			return "<nil>"
		}
		return *p
	}
	return "status=" + deref(st) + " code=" + deref(code) + " detail=" + deref(detail)
}

// failureCode is the row's last_failure_code.
func failureCode(t *testing.T, s *testdb.Schema, id string) string {
	t.Helper()
	var code *string
	require.NoError(t, s.DB.QueryRow(`SELECT last_failure_code FROM messaging_outbox WHERE message_id = $1`, id).Scan(&code))
	require.NotNil(t, code, "row %s has no failure code", id)
	return *code
}
