package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

var grantBlock = regexp.MustCompile("(?s)<!-- grants: ([a-z]+) -->\\s*```sql\\n(.*?)```")

// lpEnv is an empty schema and, per docs/SECURITY.md grants block, a
// password login holding exactly that block's grants.
type lpEnv struct {
	t        *testing.T
	schema   string
	admin    *sql.DB // superuser, search_path on the schema
	suffix   string
	password string
	blocks   map[string]string
}

func newLPEnv(t *testing.T) *lpEnv {
	t.Helper()
	doc, err := os.ReadFile("../../docs/SECURITY.md")
	require.NoError(t, err)
	e := &lpEnv{t: t, suffix: fmt.Sprintf("%d", time.Now().UnixNano()%1_000_000_000), blocks: map[string]string{}}
	e.password = "pw-" + e.suffix + "-S3cr3t"
	for _, m := range grantBlock.FindAllStringSubmatch(string(doc), -1) {
		e.blocks[m[1]] = m[2]
	}
	e.schema = "outbox_test_lpcli_" + e.suffix
	root, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	_, err = root.Exec("CREATE SCHEMA " + e.schema)
	require.NoError(t, err)
	require.NoError(t, root.Close())
	e.admin, err = sql.Open("postgres", testdb.WithSearchPath(testdb.URL(), e.schema))
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = e.admin.Exec("DROP SCHEMA IF EXISTS " + e.schema + " CASCADE")
		_ = e.admin.Close()
	})
	return e
}

// login creates the role of component with a password, runs its block
// (role outbox_<name> and schema outbox renamed) and returns the URL the
// component connects with: password in it, search_path on the schema.
func (e *lpEnv) login(component string) string {
	t := e.t
	t.Helper()
	block, ok := e.blocks[component]
	require.True(t, ok, "docs/SECURITY.md has no grants block %q", component)
	role := "outbox_lpcli_" + component + "_" + e.suffix
	_, err := e.admin.Exec("CREATE ROLE " + role + " LOGIN PASSWORD '" + e.password + "'")
	require.NoError(t, err)
	t.Cleanup(func() {
		root, err := sql.Open("postgres", testdb.URL())
		if err != nil {
			return
		}
		defer root.Close()
		_, _ = root.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
		_, _ = root.Exec("DROP SCHEMA IF EXISTS " + e.schema + " CASCADE")
		_, _ = root.Exec("DROP OWNED BY " + role)
		_, _ = root.Exec("DROP ROLE IF EXISTS " + role)
	})
	name := component
	if component == "cdcrelay" {
		name = "cdc"
	}
	block = strings.ReplaceAll(block, "outbox_"+name+" ", role+" ")
	block = strings.ReplaceAll(block, "outbox_"+name+";", role+";")
	block = strings.ReplaceAll(block, "SCHEMA outbox ", "SCHEMA "+e.schema+" ")
	for _, stmt := range strings.Split(block, ";") {
		if strings.TrimSpace(stmt) == "" {
			continue
		}
		_, err := e.admin.Exec(stmt)
		require.NoError(t, err, "grant of %s: %s", component, stmt)
	}
	u, err := url.Parse(testdb.WithSearchPath(testdb.URL(), e.schema))
	require.NoError(t, err)
	u.User = url.UserPassword(role, e.password)
	return u.String()
}

// run runs outboxctl with the database URL in OUTBOX_DATABASE_URL (as the
// deploy files give it) and requires exit 0, no permission error and no
// password in its output.
func (e *lpEnv) run(dbURL string, args ...string) result {
	t := e.t
	t.Helper()
	r := cli(t, []string{"OUTBOX_DATABASE_URL=" + dbURL}, args...)
	e.clean(fmt.Sprintf("%q", args), r.stdout+r.stderr)
	requireCode(t, r, 0)
	return r
}

// clean requires that out shows no permission error and no password.
func (e *lpEnv) clean(what, out string) {
	e.t.Helper()
	require.NotContains(e.t, out, e.password, "%s printed the password", what)
	for _, s := range []string{"permission denied", "42501", "must be owner"} {
		require.NotContains(e.t, strings.ToLower(out), s, "%s under its documented grants:\n%s", what, out)
	}
}

// Every documented login runs its component as shipped: `outboxctl migrate`,
// `outboxctl relay` (forwarder, backlog collector, /readyz, a breaker opened
// by an outage and recorded in messaging_relay_breaker, the stop), `status`
// and `inspect`, the approver's `--approve`, the operator's dry run and
// execution, `cleanup` (delete and archive), and the mode switch
// (`debezium enable|disable`), each under a password login holding exactly
// its docs/SECURITY.md block; no output carries a permission error or the
// password.
func TestEveryDocumentedLoginRunsOutboxctlAsShipped(t *testing.T) {
	t.Parallel()
	e := newLPEnv(t)
	e.run(e.login("migrate"), "migrate")

	relayURL, readerURL := e.login("relay"), e.login("reader")
	approverURL, operatorURL := e.login("approver"), e.login("operator")
	cleanupURL, modeURL := e.login("cleanup"), e.login("mode")

	testdb.InsertRow(t, e.admin, envelope.Row{MessageID: "lp-1", Destination: "orders", Payload: []byte("x")})
	testdb.InsertRow(t, e.admin, envelope.Row{MessageID: "lp-parked", Destination: "orders", Payload: []byte("x"),
		Status: envelope.StatusFailed, LastFailureCode: "X"})

	// The relay: publishes, serves /readyz and the collector's gauges, then
	// meets an outage (a stdout nobody reads) that opens the breaker.
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	cmd := exec.Command(binary, "relay", "--to", "log", "--listen", "--owner", "lp-relay", "--metrics-addr", "127.0.0.1:0",
		"--poll-interval", "50ms", "--max-poll-interval", "200ms", "--publish-timeout", "300ms", "--lease", "2s", "--heartbeat-interval", "1s")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "OUTBOX_DATABASE_URL=" + relayURL}
	cmd.Stdout = w
	stderr := &syncWriter{}
	cmd.Stderr = stderr
	require.NoError(t, cmd.Start())
	require.NoError(t, w.Close())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	published := func() bool {
		return testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox WHERE message_id = 'lp-1' AND status = 'PUBLISHED'`) == 1
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for !cond() {
			select {
			case err := <-exited:
				t.Fatalf("the relay exited (%v) before %s\nstderr:\n%s", err, what, stderr.String())
			case <-time.After(50 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 60s\nstderr:\n%s", what, stderr.String())
			}
		}
	}
	waitFor("lp-1 published", published)
	metrics := regexp.MustCompile(`http://[^\s"]+/metrics`).FindString(stderr.String())
	require.NotEmpty(t, metrics, stderr.String())
	base := strings.TrimSuffix(metrics, "/metrics")
	var ready string
	require.Eventually(t, func() bool {
		var code int
		code, ready = get(t, base+"/readyz")
		return code == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond, "/readyz under the relay login: %s", ready)
	var rz struct {
		Checks []check `json:"checks"`
	}
	require.NoError(t, json.Unmarshal([]byte(ready), &rz))
	require.Len(t, rz.Checks, 5, ready)
	_, body := get(t, metrics)
	require.Contains(t, body, `outbox_parked_messages{status="FAILED"} 1`, "the backlog collector samples under the relay login")
	require.Contains(t, body, "outbox_backlog_sample_errors_total 0")

	big := []byte(strings.Repeat("y", 64<<10))
	for i := range 6 {
		testdb.InsertRow(t, e.admin, envelope.Row{MessageID: fmt.Sprintf("lp-big-%d", i), Destination: "orders", Payload: big})
	}
	waitFor("the breaker recorded in messaging_relay_breaker", func() bool {
		return testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_relay_breaker WHERE owner = 'lp-relay' AND destination = 'orders'`) == 1
	})
	_, body = get(t, metrics)
	require.Contains(t, body, `outbox_forwarder_breaker_open{destination="orders"} 1`)

	// `status` shows the breaker to the reader; inspect reads a row.
	st := e.run(readerURL, "--json", "status")
	require.Contains(t, st.stdout, `"lp-relay"`)
	e.run(readerURL, "inspect", "lp-parked")

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, <-exited, "stderr:\n%s", stderr.String())
	e.clean("outboxctl relay", stderr.String())
	require.Zero(t, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_relay_breaker WHERE owner = 'lp-relay'`), "the relay removed its breakers on its way out")
	require.Zero(t, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = 'lp-relay'`))
	require.Zero(t, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox WHERE status = 'IN_FLIGHT'`))

	// The approver approves the operator's dry run; the operator executes
	// it (and cannot approve).
	var dry struct {
		Plan struct {
			Digest string `json:"digest"`
		} `json:"plan"`
	}
	filter := []string{"--status", "failed"}
	out := e.run(operatorURL, append([]string{"--json", "redrive", "--dry-run"}, filter...)...)
	require.NoError(t, json.Unmarshal([]byte(out.stdout), &dry), out.stdout)
	approve := append([]string{"redrive", "--ticket", "CHG-LP", "--expect-digest", dry.Plan.Digest, "--approve"}, filter...)
	self := cli(t, []string{"OUTBOX_DATABASE_URL=" + operatorURL}, approve...)
	require.NotEqual(t, 0, self.code, "the operator approved its own plan")
	require.NotContains(t, self.stdout+self.stderr, e.password)
	e.run(approverURL, approve...)
	done := e.run(operatorURL, append([]string{"redrive", "--ticket", "CHG-LP", "--expect-digest", dry.Plan.Digest}, filter...)...)
	require.Contains(t, done.stdout, "redrive complete under ticket CHG-LP")

	// cleanup, delete and archive mode (inbox included).
	_, err = e.admin.Exec(`UPDATE messaging_outbox SET status = 'PUBLISHED', published_at = now() - interval '100 hours', lease_owner = NULL, lease_expires_at = NULL
	 WHERE status <> 'PUBLISHED' OR published_at IS NOT NULL`)
	require.NoError(t, err)
	e.run(cleanupURL, "cleanup", "--horizon", "72h", "--max-batches", "1", "--batch-size", "2", "--inbox-horizon", "720h")
	e.run(cleanupURL, "cleanup", "--horizon", "72h", "--archive", "--inbox-horizon", "720h")
	require.Zero(t, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox`))
	require.Positive(t, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox_archive`))

	// The mode switch, both ways (no relay is live now).
	e.run(modeURL, "debezium", "enable", "--by", "lp-test")
	e.run(modeURL, "debezium", "disable", "--by", "lp-test")
	var mode string
	require.NoError(t, e.admin.QueryRowContext(context.Background(), `SELECT mode FROM messaging_relay_mode`).Scan(&mode))
	require.Equal(t, "POLLING", mode)
}
