package main

import (
	"context"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// slowProxy forwards TCP connections to target, holding every chunk for
// delay in each direction: a database that answers slowly. cut stops
// forwarding (connections stay open, nothing passes): a database that
// stopped answering.
type slowProxy struct {
	ln     net.Listener
	target string
	delay  time.Duration

	mu    sync.Mutex
	conns []net.Conn
	cut   chan struct{}
	done  chan struct{}
	once  sync.Once
	wg    sync.WaitGroup
}

func startSlowProxy(t *testing.T, target string, delay time.Duration) *slowProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &slowProxy{ln: ln, target: target, delay: delay, cut: make(chan struct{}), done: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *slowProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(s, c)
		go p.pipe(c, s)
	}
}

// pipe copies from src to dst, each chunk delayed; after cut, it reads
// and drops nothing: it stops reading.
func (p *slowProxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			select {
			case <-time.After(p.delay):
			case <-p.cut:
				<-p.done // held, forwarding nothing, until the test ends
				return
			}
			select {
			case <-p.cut:
				return
			default:
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			_ = dst.Close()
			return
		}
	}
}

func (p *slowProxy) close() {
	p.once.Do(func() { close(p.cut) })
	close(p.done)
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
}

// url is s's URL through the proxy.
func (p *slowProxy) url(t *testing.T, s *testdb.Schema) string {
	t.Helper()
	u := strings.Replace(s.URL, "@"+p.target+"/", "@"+p.ln.Addr().String()+"/", 1)
	require.NotEqual(t, s.URL, u, "the schema URL does not name %s", p.target)
	return u
}

// printGrace runs `outboxctl relay --print-grace` with args.
func printGrace(t *testing.T, args ...string) time.Duration {
	t.Helper()
	r := cli(t, nil, append([]string{"relay", "--print-grace"}, args...)...)
	requireCode(t, r, 0)
	n, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	require.NoError(t, err, r.stdout)
	return time.Duration(n) * time.Second
}

// The stop issue 32 found: `outboxctl relay --to log` whose stdout nobody
// reads, on a database that answers slowly (100 ms more each way for every
// chunk), with the heartbeat row locked
// by another session while it stops (so the heartbeat's removal runs into
// its timeout), exits 0 within the grace --print-grace gives and leaves no
// row IN_FLIGHT.
func TestRelayStopsWithinPrintedGraceOnSlowDatabaseAndStalledStdout(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	rows := make([]testdb.OutboxRow, 0, 60)
	payload := []byte(strings.Repeat("x", 4096)) // ~10 KB a line: a pipe holds a few
	for i := range 60 {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "stop-" + strconv.Itoa(i), Destination: "orders", Payload: payload}))
	}
	testdb.InsertRows(t, s.DB, rows...)

	proxy := startSlowProxy(t, "127.0.0.1:5432", 100*time.Millisecond)
	if !strings.Contains(s.URL, "@127.0.0.1:5432/") {
		t.Skipf("the test database URL %q is not on 127.0.0.1:5432, where the proxy forwards", s.URL)
	}
	flags := []string{"--to", "log", "--metrics-addr", "127.0.0.1:0", "--owner", "stop-test",
		"--lease", "8s", "--publish-timeout", "1s", "--drain-timeout", "1s", "--db-timeout", "2s",
		"--heartbeat-interval", "1s", "--poll-interval", "50ms", "--max-poll-interval", "200ms"}
	grace := printGrace(t, flags...)

	// stdout: a pipe nobody reads.
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	cmd := exec.Command(binary, append([]string{"--database-url", proxy.url(t, s), "relay"}, flags...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	cmd.Stdout = w
	stderr := &syncWriter{}
	cmd.Stderr = stderr
	require.NoError(t, cmd.Start())
	require.NoError(t, w.Close()) // the child holds its own copy
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	// The pipe is full: a publish timed out on it and was recorded
	// AMBIGUOUS.
	require.Eventually(t, func() bool { return s.Count(t, "status = 'AMBIGUOUS'") > 0 },
		60*time.Second, 50*time.Millisecond, "no publish blocked on the unread stdout\nstderr:\n%s", stderr.String())

	// Another session holds the heartbeat row: the relay's removal of it
	// waits for its timeout.
	tx, err := s.DB.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	var owner string
	require.NoError(t, tx.QueryRow(`SELECT owner FROM messaging_relay_heartbeat WHERE owner = 'stop-test' FOR UPDATE`).Scan(&owner))

	stopped := time.Now()
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	var exitErr error
	select {
	case exitErr = <-exited:
	case <-time.After(grace):
		t.Fatalf("the relay had not exited %s (its printed grace) after SIGTERM\nstderr:\n%s", grace, stderr.String())
	}
	took := time.Since(stopped)
	require.NoError(t, exitErr, "stderr:\n%s", stderr.String())
	t.Logf("stopped in %s, grace %s", took, grace)
	require.LessOrEqual(t, took, grace)
	require.NoError(t, tx.Rollback())
	require.Contains(t, stderr.String(), "relay stop-test stopped")
	require.Contains(t, stderr.String(), "downstream not closed cleanly", "the blocked write was not the one Close waited for")
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"), "rows left IN_FLIGHT\nstderr:\n%s", stderr.String())
}

// A database that stops answering altogether while the relay stops (every
// statement of the stop hangs): the relay does not wait to be killed; it
// exits 1 with OUTBOXCTL_RELAY_STOP_TIMEOUT within the printed grace.
func TestRelayStopEndsWithinGraceWhenTheDatabaseStopsAnswering(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "cut-1", Destination: "orders", Payload: []byte("x")})
	proxy := startSlowProxy(t, "127.0.0.1:5432", 0)
	if !strings.Contains(s.URL, "@127.0.0.1:5432/") {
		t.Skipf("the test database URL %q is not on 127.0.0.1:5432, where the proxy forwards", s.URL)
	}
	flags := []string{"--to", "log", "--owner", "cut-test",
		"--lease", "4s", "--publish-timeout", "1s", "--drain-timeout", "1s", "--db-timeout", "1s",
		"--heartbeat-interval", "1s", "--poll-interval", "50ms", "--max-poll-interval", "200ms"}
	grace := printGrace(t, flags...)
	p := startRelayProc(t, nil, append([]string{"--database-url", proxy.url(t, s), "relay"}, flags...)...)
	waitStatus(t, s, &syncWriter{}, "cut-1", "PUBLISHED")

	proxy.once.Do(func() { close(proxy.cut) })
	stopped := time.Now()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	exited := make(chan error, 1)
	go func() { <-p.errEnd; exited <- p.cmd.Wait() }()
	var err error
	select {
	case err = <-exited:
	case <-time.After(grace):
		t.Fatalf("the relay had not exited %s (its printed grace) after SIGTERM\nstderr:\n%s", grace, p.log.String())
	}
	t.Logf("stopped in %s, grace %s: %v", time.Since(stopped), grace, err)
	require.LessOrEqual(t, time.Since(stopped), grace)
	// lib/pq does not end a statement whose context expired on a
	// connection that stopped answering (its cancel request goes to the
	// same silent server), so the heartbeat's removal hangs: the relay
	// gives up at the forwarder's bound.
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, p.log.String())
	require.Equal(t, ExitFailed, exit.ExitCode(), p.log.String())
	require.Contains(t, p.log.String(), string(CodeRelayStopTimeout))
	require.NotContains(t, p.log.String(), "relay cut-test stopped")
}

// --print-grace opens nothing (no database URL is needed), follows the
// settings from flags and the environment, and refuses a configuration the
// relay would refuse, with the relay's own code.
func TestPrintGraceFollowsTheSettingsAndRefusesBadOnes(t *testing.T) {
	t.Parallel()
	small := printGrace(t, "--lease", "8s", "--publish-timeout", "1s", "--drain-timeout", "1s", "--db-timeout", "2s", "--heartbeat-interval", "1s")
	// drain 1s + 4 x 2s + 2s, the downstream's and the pool's closes 5s
	// each, the margin 5s.
	require.Equal(t, 26*time.Second, small)
	withOps := printGrace(t, "--lease", "8s", "--publish-timeout", "1s", "--drain-timeout", "1s", "--db-timeout", "2s", "--heartbeat-interval", "1s",
		"--metrics-addr", "127.0.0.1:9464")
	require.Equal(t, small+opsShutdownTimeout, withOps, "the listener's shutdown comes first")
	r := cli(t, []string{"OUTBOX_HEARTBEAT_INTERVAL=1m"}, "relay", "--print-grace", "--lease", "8s", "--publish-timeout", "1s", "--db-timeout", "2s")
	requireCode(t, r, 0)
	require.Equal(t, strconv.Itoa(60+2+5+5+5), strings.TrimSpace(r.stdout), "a heartbeat longer than the drain bounds the stop")

	r = cli(t, nil, "relay", "--print-grace", "--lease", "1s", "--publish-timeout", "1s")
	requireCode(t, r, ExitUsage)
	require.Contains(t, r.stderr, "OUTBOX_LEASE_TOO_SHORT")
	require.Empty(t, r.stdout)
	r = cli(t, nil, "relay", "--print-grace", "--db-timeout", "-1s")
	requireCode(t, r, ExitUsage)
	require.Contains(t, r.stderr, "OUTBOX_INVALID_CONFIG")
}
