package main

import (
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/fencedoutbox/watermill-outbox/internal/brokertest"
	"github.com/fencedoutbox/watermill-outbox/internal/testdb"
)

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

// TestRelayToKafka runs the built relay against kfake, an in-process Kafka
// speaking the real protocol, with auto topic creation off.
func TestRelayToKafka(t *testing.T) {
	t.Parallel()
	brokers := brokertest.Kafka(t, kfake.SeedTopics(2, "orders"))
	s := newSchema(t)
	exec1(t, s.DB, `
INSERT INTO messaging_outbox (message_id, destination, payload, headers, partition_key)
VALUES ('k-1', 'orders', 'one', '{"app":"shop"}', 'customer-1'),
       ('k-2', 'orders', 'two', '{}', NULL),
       ('k-missing', 'no-such-topic', 'x', '{}', NULL)`)

	cmd, stderr := startRelay(t, s, nil, "--to", "kafka", "--kafka-brokers", strings.Join(brokers, ","))
	waitStatus(t, s, stderr, "k-1", "PUBLISHED")
	waitStatus(t, s, stderr, "k-2", "PUBLISHED")
	// kafka.Classify is the relay's classifier: a missing topic is a
	// rejection with the broker's error name (the default would retry it).
	waitStatus(t, s, stderr, "k-missing", "FAILED")
	require.Equal(t, "KAFKA_UNKNOWN_TOPIC_OR_PARTITION", failureCode(t, s, "k-missing"))

	got := map[string]brokertest.KafkaRecord{}
	for _, r := range brokertest.ReadKafka(t, brokers, "orders") {
		got[r.UUID()] = r
	}
	require.Len(t, got, 2)
	require.Equal(t, "one", string(got["k-1"].Value))
	require.Equal(t, "customer-1", got["k-1"].Key, "record key is the partition key")
	require.Equal(t, "shop", got["k-1"].Headers["app"])
	require.Equal(t, "two", string(got["k-2"].Value))
	require.Equal(t, "k-2", got["k-2"].Key, "record key falls back to the UUID")

	stopRelay(t, cmd, stderr)
}

func TestRelayToKafkaBadBrokers(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	for _, tc := range []struct{ brokers, detail string }{
		{"", "at least one bootstrap address"},
		{" , ", "empty address"},
		{"127.0.0.1:9092,,127.0.0.1:9093", "empty address"},
	} {
		r := db(t, s, "relay", "--to", "kafka", "--kafka-brokers", tc.brokers)
		requireCode(t, r, 2)
		require.Contains(t, r.stderr, "code: OUTBOX_INVALID_CONFIG", "brokers %q", tc.brokers)
		require.Contains(t, r.stderr, tc.detail, "brokers %q", tc.brokers)
	}
}
