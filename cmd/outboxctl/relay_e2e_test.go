package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/stretchr/testify/require"
)

func TestRelayToLogPublishesServesMetricsAndStopsCleanly(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	var rows []testdb.OutboxRow
	for g := 1; g <= 5; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: fmt.Sprintf("m-%d", g), Destination: "orders",
			Payload: []byte(fmt.Sprintf(`{"n":%d}`, g)), Headers: map[string]string{"app": "shop"}, CorrelationID: fmt.Sprintf("c-%d", g)}))
	}
	testdb.InsertRows(t, s.DB, rows...)

	cmd := exec.Command(binary, "--database-url", s.URL, "relay", "--to", "log", "--metrics-addr", "127.0.0.1:0",
		"--poll-interval", "50ms", "--max-poll-interval", "200ms", "--owner", "relay-e2e")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	metricsURL := make(chan string, 1)
	var errLog syncBuffer
	errDone := make(chan struct{})
	go func() {
		defer close(errDone)
		sc := bufio.NewScanner(stderr)
		re := regexp.MustCompile(`metrics on (http://[^\s"]+)`)
		for sc.Scan() {
			errLog.WriteString(sc.Text() + "\n")
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				metricsURL <- m[1]
			}
		}
	}()

	// Five JSON lines, one per row, with the id and metadata of the row.
	lines := make(chan map[string]any)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var l map[string]any
			if json.Unmarshal(sc.Bytes(), &l) == nil {
				lines <- l
			}
		}
	}()
	seen := map[string]map[string]any{}
	deadline := time.After(30 * time.Second)
	for len(seen) < 5 {
		select {
		case l, ok := <-lines:
			require.True(t, ok, "relay stdout closed early; stderr:\n%s", errLog.String())
			seen[l["uuid"].(string)] = l
		case <-deadline:
			t.Fatalf("relay published %d of 5 messages; stderr:\n%s", len(seen), errLog.String())
		}
	}
	m1 := seen["m-1"]
	require.Equal(t, "orders", m1["topic"])
	require.Equal(t, `{"n":1}`, m1["payload_text"])
	md := m1["metadata"].(map[string]any)
	require.Equal(t, "shop", md["app"])
	require.Equal(t, "c-1", md["correlation_id"])
	await.Until(t, func() bool { return s.Count(t, "status = 'PUBLISHED'") == 5 }, "the five rows are PUBLISHED")

	// /metrics: the forwarder's counters and the backlog gauges.
	var url string
	select {
	case url = <-metricsURL:
	case <-time.After(10 * time.Second):
		t.Fatalf("no metrics address; stderr:\n%s", errLog.String())
	}
	resp, err := http.Get(url)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	require.Contains(t, string(body), "outbox_forwarder_messages_total")
	require.Contains(t, string(body), "outbox_oldest_pending_age_seconds")
	require.Contains(t, string(body), `outbox_parked_messages{status="FAILED"} 0`)

	// The live relay blocks a switch to CDC...
	r := db(t, s, "debezium", "enable", "--by", "test")
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "relay-e2e")

	// ...and SIGTERM stops it cleanly: exit 0, heartbeat removed.
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	<-errDone
	err = cmd.Wait()
	require.NoError(t, err, "stderr:\n%s", errLog.String())
	require.Contains(t, errLog.String(), "relay relay-e2e stopped")
	requireCode(t, db(t, s, "debezium", "enable", "--by", "test"), 0)

	// In CDC mode the relay refuses to start.
	r = db(t, s, "relay", "--to", "log")
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "code: RELAY_MODE_CONFLICT")
}

func TestRelayUsageErrors(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	for _, c := range []struct {
		args []string
		want []string // each in stderr
	}{
		{[]string{"--to", "carrier-pigeon"}, []string{"supports: log"}},
		{[]string{"--to", "log", "--lease", "1s", "--publish-timeout", "1s"}, []string{"OUTBOX_LEASE_TOO_SHORT"}},
		// The containment settings reach the forwarder's Config.Validate.
		{[]string{"--to", "log", "--db-timeout", "20s"}, []string{"OUTBOX_INVALID_CONFIG", "DBTimeout 20s exceeds half of LeaseDuration"}},
		{[]string{"--to", "log", "--max-batch-bytes", "-1"}, []string{"MaxBatchBytes"}},
		{[]string{"--to", "log", "--max-abandoned", "-1"}, []string{"MaxAbandoned"}},
		{[]string{"--to", "log", "--batch-size", "50", "--max-batch-size", "20"}, []string{"MaxBatchSize 20 is below BatchSize 50"}},
		{[]string{"--to", "log", "--max-batch-size", "-1"}, []string{"MaxBatchSize"}},
		{[]string{"--to", "log", "--fence", "cells"}, []string{`"cells" is not a fence scheme (rows or lanes)`}},
	} {
		r := db(t, s, append([]string{"relay"}, c.args...)...)
		requireCode(t, r, 2)
		for _, w := range c.want {
			require.Contains(t, r.stderr, w, "relay %v", c.args)
		}
	}
}

// --fence lanes: the relay takes the lanes, delivers, shows them in
// outboxctl status, and gives them back when it stops.
func TestRelayOnLanesDeliversAndGivesItsLanesBack(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "m1", Destination: "orders", Payload: []byte("one"), OrderingKey: "order-1"})
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "m2", Destination: "orders", Payload: []byte("two")})
	// Without the lanes' index a lane relay refuses to start.
	r := db(t, s, "relay", "--to", "log", "--fence", "lanes")
	requireCode(t, r, 1)
	require.Contains(t, r.stderr, "LANES_MISSING")
	require.Contains(t, r.stderr, "outboxctl lanes set 32")
	r = db(t, s, "lanes", "set", "0")
	requireCode(t, r, 2)
	r = db(t, s, "lanes", "set", "32")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "lanes: 32 (index messaging_outbox_lane_idx built)")
	cmd, stderr := startRelay(t, s, nil, "--to", "log", "--owner", "lane-relay", "--fence", "lanes")
	waitStatus(t, s, stderr, "m1", "PUBLISHED")
	waitStatus(t, s, stderr, "m2", "PUBLISHED")
	var owner string
	require.NoError(t, s.DB.QueryRow(`SELECT lease_owner FROM messaging_outbox WHERE message_id = 'm1'`).Scan(&owner))
	require.Equal(t, "lane-relay", owner, "the outcome records the relay that wrote it")
	r = db(t, s, "lanes", "set", "16")
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "LANES_BUSY")
	r = db(t, s, "status")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "LANES (fence LANES)")
	require.Contains(t, r.stdout, "lane-relay")
	stopRelay(t, cmd, stderr)
	var owned int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_lane WHERE owner IS NOT NULL`).Scan(&owned))
	require.Zero(t, owned, "every lane given back at the stop")
}

// syncBuffer collects the relay's stderr while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) WriteString(v string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b.WriteString(v)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// syncWriter is an io.Writer the test can read while the child writes.
type syncWriter struct{ b syncBuffer }

func (w *syncWriter) Write(p []byte) (int, error) { w.b.WriteString(string(p)); return len(p), nil }
func (w *syncWriter) String() string              { return w.b.String() }
