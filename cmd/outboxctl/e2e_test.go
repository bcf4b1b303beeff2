package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// binary is the outboxctl built once for the package's tests: every test
// runs the real executable, as an operator would.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "outboxctl-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "outboxctl")
	build := exec.Command("go", "build", "-o", binary, ".")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build outboxctl:", err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

type result struct {
	stdout, stderr string
	code           int
}

// cli runs the binary with env (KEY=VALUE) added to a clean environment:
// OUTBOX_DATABASE_URL is never inherited from the developer's shell.
func cli(t *testing.T, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return result{stdout: out.String(), stderr: errb.String(), code: code}
}

// db runs the binary against s with --database-url.
func db(t *testing.T, s *testdb.Schema, args ...string) result {
	t.Helper()
	return cli(t, nil, append([]string{"--database-url", s.URL}, args...)...)
}

func requireCode(t *testing.T, r result, code int) {
	t.Helper()
	require.Equal(t, code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
}

func newSchema(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	return s
}

// insertOldPublished writes n PUBLISHED rows old-1..old-n, published 100
// hours before the database's now().
func insertOldPublished(t *testing.T, s *testdb.Schema, n int) {
	t.Helper()
	rows := make([]testdb.OutboxRow, 0, n)
	for g := 1; g <= n; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "old-" + strconv.Itoa(g), Destination: "orders", Payload: []byte("x"),
			Status: envelope.StatusPublished}, testdb.SQL("published_at", "now() - interval '100 hours'")))
	}
	testdb.InsertRows(t, s.DB, rows...)
}

func exec1(t *testing.T, d *sql.DB, q string, args ...any) {
	t.Helper()
	_, err := d.Exec(q, args...)
	require.NoError(t, err)
}

func TestMigrateAppliesEmbeddedMigrations(t *testing.T) {
	t.Parallel()
	admin, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	defer admin.Close()
	name := fmt.Sprintf("outbox_test_%d_cli%d", time.Now().Unix(), time.Now().UnixNano()%100000)
	exec1(t, admin, "CREATE SCHEMA "+name)
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA IF EXISTS " + name + " CASCADE") })
	url := testdb.WithSearchPath(testdb.URL(), name)

	// The URL from the environment works as well as the flag.
	r := cli(t, []string{"OUTBOX_DATABASE_URL=" + url}, "migrate")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "applied 00001\n")
	require.Contains(t, r.stdout, "applied 00005\n")
	require.Regexp(t, `schema at version \d+\n$`, r.stdout)

	r = cli(t, nil, "--database-url", url, "--json", "migrate")
	requireCode(t, r, 0)
	var out struct {
		Applied []int64 `json:"applied"`
		Current int64   `json:"current"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	require.Empty(t, out.Applied)
	require.Positive(t, out.Current)

	var n int
	require.NoError(t, admin.QueryRow(`SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'messaging_outbox'`, name).Scan(&n))
	require.Equal(t, 1, n)
}

func seedStatus(t *testing.T, s *testdb.Schema) {
	t.Helper()
	ago := func(interval string) testdb.RowOption {
		return testdb.SQL("created_at", "now() - interval '"+interval+"'")
	}
	testdb.InsertRows(t, s.DB, // one statement: one now(), parked_at included
		testdb.Row(envelope.Row{MessageID: "p1", Destination: "orders", Payload: []byte("hello"), Tenant: "acme",
			CorrelationID: "flow-slow", Headers: map[string]string{"trace": "t-1"}}, ago("2 hours")),
		testdb.Row(envelope.Row{MessageID: "p2", Destination: "billing", Payload: []byte("x"), CorrelationID: "flow-ok"}, ago("1 minute")),
		testdb.Row(envelope.Row{MessageID: "f1", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusFailed,
			Tenant: "acme", CorrelationID: "flow-park", LastFailureCode: "REJECTED"}, ago("10 minutes")),
		testdb.Row(envelope.Row{MessageID: "e1", Destination: "billing", Payload: []byte("x"), Status: envelope.StatusExhausted,
			LastFailureCode: "PUBLISH_TIMEOUT"}, ago("20 minutes")),
		testdb.Row(envelope.Row{MessageID: "a1", Destination: "billing", Payload: []byte("x"), Status: envelope.StatusAmbiguous,
			LastFailureCode: "PUBLISH_TIMEOUT"}, ago("5 minutes")),
		testdb.Row(envelope.Row{MessageID: "done", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusPublished},
			ago("5 hours"), testdb.SQL("published_at", "now() - interval '4 hours'")),
	)
	require.NoError(t, relaymode.Beat(context.Background(), s.DB, "relay-a", time.Hour))
}

func TestStatusHumanAndJSON(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedStatus(t, s)

	r := db(t, s, "status")
	requireCode(t, r, 0)
	for _, want := range []string{
		"relay mode:   POLLING",
		"unpublished:  5",
		"in transit:   3 (PENDING, IN_FLIGHT, AMBIGUOUS), oldest 2h0m",
		"failed:       1",
		"exhausted:    1",
		"ambiguous:    1",
		"BACKLOG", "TOP FAILURE CODES", "STUCK CORRELATIONS", "LIVE RELAYS",
		"relay-a",
	} {
		require.Contains(t, r.stdout, want)
	}
	// Aligned columns: the header and a data row line up.
	require.Regexp(t, `(?m)^STATUS\s+DESTINATION\s+TENANT\s+COUNT\s+OLDEST$`, r.stdout)
	require.Regexp(t, `(?m)^PENDING\s+orders\s+acme\s+1\s+\d{4}-`, r.stdout)
	require.Regexp(t, `(?m)^FAILED\s+REJECTED\s+1$`, r.stdout)
	require.Regexp(t, `(?m)^flow-slow\s+0\s+1\s+`, r.stdout)
	require.Regexp(t, `(?m)^flow-park\s+1\s+0\s+`, r.stdout)
	require.NotContains(t, r.stdout, "flow-ok")

	r = db(t, s, "--json", "status", "--stuck-after", "1h")
	requireCode(t, r, 0)
	var snap struct {
		RelayMode    string  `json:"relay_mode"`
		Unpublished  int64   `json:"unpublished"`
		Pending      int64   `json:"pending"`
		Failed       int64   `json:"failed"`
		Exhausted    int64   `json:"exhausted"`
		Ambiguous    int64   `json:"ambiguous"`
		OldestAge    float64 `json:"oldest_pending_age_seconds"`
		FailureCodes []struct {
			Status, Code string
			Count        int64
		} `json:"failure_codes"`
		Stuck []struct {
			CorrelationID string `json:"correlation_id"`
		} `json:"stuck_correlations"`
		Relays []struct {
			Owner string `json:"owner"`
		} `json:"live_relays"`
		ByTenant []struct {
			Key   string
			Count int64
		} `json:"by_tenant"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &snap), r.stdout)
	require.Equal(t, "POLLING", snap.RelayMode)
	require.EqualValues(t, 5, snap.Unpublished)
	require.EqualValues(t, 3, snap.Pending)
	require.EqualValues(t, 1, snap.Failed)
	require.EqualValues(t, 1, snap.Exhausted)
	require.EqualValues(t, 1, snap.Ambiguous)
	require.InDelta(t, 7200, snap.OldestAge, 120)
	var codes []string
	for _, f := range snap.FailureCodes {
		codes = append(codes, fmt.Sprintf("%s/%s=%d", f.Status, f.Code, f.Count))
	}
	require.Equal(t, []string{"AMBIGUOUS/PUBLISH_TIMEOUT=1", "EXHAUSTED/PUBLISH_TIMEOUT=1", "FAILED/REJECTED=1"}, codes)
	require.Len(t, snap.Stuck, 2)
	require.Equal(t, "flow-slow", snap.Stuck[0].CorrelationID)
	require.Equal(t, "flow-park", snap.Stuck[1].CorrelationID)
	require.Len(t, snap.Relays, 1)
	require.Equal(t, "", snap.ByTenant[0].Key) // rows without a tenant: p2, e1, a1
	require.EqualValues(t, 3, snap.ByTenant[0].Count)
	require.Equal(t, "acme", snap.ByTenant[1].Key)

	// A bad flag value is a usage error.
	requireCode(t, db(t, s, "status", "--max-groups", "-1"), 2)
}

func TestInspect(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedStatus(t, s)
	exec1(t, s.DB, `UPDATE messaging_outbox SET lease_owner = 'relay-a', lease_token = 4, attempts = 2,
	    last_failure_detail = 'broker said no', partition_key = 'k-1' WHERE message_id = 'f1'`)

	r := db(t, s, "inspect", "f1")
	requireCode(t, r, 0)
	for _, re := range []string{
		`(?m)^message_id\s+f1$`, `(?m)^status\s+FAILED$`, `(?m)^lease_owner\s+relay-a$`, `(?m)^lease_token\s+4$`,
		`(?m)^attempts\s+2$`, `(?m)^last_failure_code\s+REJECTED$`, `(?m)^last_failure_detail\s+broker said no$`,
		`(?m)^routing_key\s+k-1$`, `(?m)^tenant\s+acme$`, `(?m)^occurred_at\s+-$`, `(?m)^parked_at\s+\d{4}-`,
		`(?m)^payload\s+1 bytes, text: x$`,
	} {
		require.Regexp(t, re, r.stdout)
	}

	r = db(t, s, "--json", "inspect", "p1")
	requireCode(t, r, 0)
	var row map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &row))
	require.Equal(t, "p1", row["message_id"])
	require.Equal(t, "hello", row["payload_text"])
	require.Equal(t, map[string]any{"trace": "t-1"}, row["headers"])
	require.Nil(t, row["lease_owner"])
	require.Contains(t, row, "aggregate_version")
	require.Len(t, row, 33+4) // 33 columns + headers + 3 payload renderings

	r = db(t, s, "inspect", "missing")
	requireCode(t, r, 1)
	require.Contains(t, r.stderr, "code: STATUS_MESSAGE_NOT_FOUND")

	r = db(t, s, "--json", "inspect", "missing")
	requireCode(t, r, 1)
	var e map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stderr), &e))
	require.Equal(t, "STATUS_MESSAGE_NOT_FOUND", e["code"])
	require.EqualValues(t, 1, e["exit_code"])

	requireCode(t, db(t, s, "inspect"), 2)
	requireCode(t, db(t, s, "inspect", "a", "b"), 2)
	requireCode(t, db(t, s, "inspect", ""), 2) // OUTBOX_MESSAGE_ID_REQUIRED

	// An id no row can have (invalid UTF-8) is not found, not an untyped
	// database error.
	r = db(t, s, "inspect", "\xff")
	requireCode(t, r, 1)
	require.Contains(t, r.stderr, "code: STATUS_MESSAGE_NOT_FOUND")
}

func TestCleanupDeletesInBatchesWithProgress(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertOldPublished(t, s, 25)
	testdb.InsertRows(t, s.DB,
		testdb.Row(envelope.Row{MessageID: "new", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusPublished}),
		testdb.Row(envelope.Row{MessageID: "parked", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusFailed},
			testdb.SQL("created_at", "now() - interval '100 hours'")))

	r := db(t, s, "cleanup", "--batch-size", "10", "--horizon", "72h")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^deleted\s+25$`, r.stdout)
	require.Regexp(t, `(?m)^batches\s+3$`, r.stdout)
	require.Contains(t, r.stderr, "batch 1 on messaging_outbox: 10 rows")
	require.Contains(t, r.stderr, "batch 3 on messaging_outbox: 5 rows")
	require.Equal(t, 2, s.Count(t, ""))

	// --by-created-at removes rows of any status: refused outside CDC mode.
	r = db(t, s, "cleanup", "--by-created-at")
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_RETENTION_MODE_MISMATCH")
	require.Equal(t, 2, s.Count(t, ""))

	requireCode(t, db(t, s, "cleanup", "--batch-size", "-5"), 2)
	requireCode(t, db(t, s, "cleanup", "--horizon", "soon"), 2)

	// In CDC mode it is the retention that works.
	requireCode(t, db(t, s, "debezium", "enable", "--by", "test"), 0)
	r = db(t, s, "--json", "cleanup", "--by-created-at", "--horizon", "72h")
	requireCode(t, r, 0)
	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
	require.EqualValues(t, 1, res["deleted"])
	require.Equal(t, "BY_CREATED_AT", res["mode"])
	require.Equal(t, 1, s.Count(t, "message_id = 'new'"))

	// Without --by-created-at in CDC mode the run is allowed but warned about.
	r = db(t, s, "cleanup", "--horizon", "72h")
	requireCode(t, r, 0)
	require.Contains(t, r.stderr, "warning: relay mode is CDC")
	require.Equal(t, 1, s.Count(t, "message_id = 'new'"))
}

func TestDebeziumConfigEqualsGenerator(t *testing.T) {
	t.Parallel()
	var want bytes.Buffer
	require.NoError(t, debezium.Generate(debezium.Options{TopicPrefix: "acme."}).WriteJSON(&want))
	// No database needed to generate a configuration.
	r := cli(t, nil, "debezium", "config", "--topic-prefix", "acme.")
	requireCode(t, r, 0)
	require.Equal(t, want.String(), r.stdout)

	want.Reset()
	require.NoError(t, debezium.Generate(debezium.Options{}).WriteProperties(&want))
	file := filepath.Join(t.TempDir(), "c.properties")
	r = cli(t, nil, "debezium", "config", "--format", "properties", "-o", file)
	requireCode(t, r, 0)
	got, err := os.ReadFile(file)
	require.NoError(t, err)
	require.Equal(t, want.String(), string(got))

	// The shipped files are exactly what the command writes.
	shipped, err := os.ReadFile("../../debezium/outbox-connector.properties")
	require.NoError(t, err)
	require.Equal(t, string(shipped), string(got))

	r = cli(t, nil, "debezium", "config", "--format", "yaml")
	requireCode(t, r, 2)
	r = cli(t, nil, "debezium", "config", "--topic-prefix", "bad$")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "OUTBOX_INVALID_CONFIG")
}

func TestDebeziumEnableRefusedWhileRelaysLive(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	ctx := context.Background()
	require.NoError(t, relaymode.Beat(ctx, s.DB, "relay-a", time.Hour))

	r := db(t, s, "debezium", "enable", "--by", "ops")
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "code: RELAY_MODE_CONFLICT")
	require.Contains(t, r.stderr, "relay-a")

	require.NoError(t, relaymode.Leave(ctx, s.DB, "relay-a"))
	r = db(t, s, "debezium", "enable", "--by", "ops")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "relay mode: CDC")
	// The forwarder's guard now refuses a polling relay.
	require.ErrorIs(t, relaymode.Beat(ctx, s.DB, "relay-b", time.Hour), relaymode.ErrRelayModeConflict)

	r = db(t, s, "--json", "debezium", "status")
	requireCode(t, r, 0)
	var st map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Equal(t, "CDC", st["relay_mode"])

	requireCode(t, db(t, s, "debezium", "disable", "--by", ""), 2) // RELAY_MODE_OPERATOR_REQUIRED
	// An operator name PostgreSQL cannot store or a terminal would act on
	// is refused before the database is touched: a usage error with its code.
	for _, sub := range []string{"enable", "disable"} {
		for _, by := range []string{"\xff", "ops\x1b[2J", "ops\nforged", "ops\u0085"} {
			r = db(t, s, "debezium", sub, "--by", by)
			requireCode(t, r, 2)
			require.Contains(t, r.stderr, "code: OUTBOXCTL_USAGE", "%s --by %q", sub, by)
			require.NotContains(t, r.stderr, "\x1b", "%s --by %q", sub, by)
		}
	}
	r = db(t, s, "debezium", "status")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "relay mode: CDC", "the refused disable changed nothing")
	r = db(t, s, "debezium", "disable", "--by", "ops")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "relay mode: POLLING")
	require.NoError(t, relaymode.Beat(ctx, s.DB, "relay-b", time.Hour))
}

func TestUsageAndConnectionErrors(t *testing.T) {
	t.Parallel()
	r := cli(t, nil, "status")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_DATABASE_URL_REQUIRED")
	require.Contains(t, r.stderr, "OUTBOX_DATABASE_URL")

	requireCode(t, cli(t, nil, "no-such-command"), 2)
	requireCode(t, cli(t, nil, "status", "--no-such-flag"), 2)
	requireCode(t, cli(t, nil, "migrate", "extra-arg"), 2)

	// A negative --timeout is refused, not read as "none" (0 is none),
	// before any connection, on every command.
	for _, args := range [][]string{{"--timeout", "-1s", "status"}, {"--timeout=-1ns", "version"}, {"--json", "--timeout", "-5m", "relay", "--to", "log"}} {
		r = cli(t, nil, args...)
		requireCode(t, r, 2)
		if args[0] == "--json" {
			require.Contains(t, r.stderr, `"code":"OUTBOXCTL_USAGE"`, "%q", args)
		} else {
			require.Contains(t, r.stderr, "code: OUTBOXCTL_USAGE", "%q", args)
		}
		require.Contains(t, r.stderr, "--timeout is -", "%q", args)
	}

	r = cli(t, nil, "--database-url", "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2", "status")
	requireCode(t, r, 4)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_DATABASE_UNREACHABLE")

	// The server answers and refuses the settings: no retry will help.
	for _, url := range []string{
		"postgres://postgres@127.0.0.1:5432/no_such_database_x?sslmode=disable",
		"postgres://no_such_role_x@127.0.0.1:5432/test?sslmode=disable",
		"postgres://postgres@127.0.0.1:5432/test?sslmode=disable&statement_timeout=abc",
	} {
		r = cli(t, nil, "--database-url", url, "status")
		requireCode(t, r, 2)
		require.Contains(t, r.stderr, "code: OUTBOXCTL_DATABASE_REFUSED", url)
	}

	r = cli(t, nil, "--help")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "Exit codes:")
	require.Contains(t, r.stdout, "3  refused by a guard")
}

// The relay's LISTEN connection and openDB read the URL through one helper, so
// a padded flag or variable resolves the same way for both.
func TestResolvedURLTrimsAndFallsBackToEnv(t *testing.T) {
	t.Parallel()
	env := func(v string) func(string) string {
		return func(k string) string {
			if k == "OUTBOX_DATABASE_URL" {
				return v
			}
			return ""
		}
	}
	require.Equal(t, "postgres://flag", (&app{databaseURL: " postgres://flag\n", getenv: env("postgres://env")}).resolvedURL())
	require.Equal(t, "postgres://env", (&app{databaseURL: "  ", getenv: env(" postgres://env ")}).resolvedURL())
	require.Empty(t, (&app{databaseURL: " ", getenv: env(" ")}).resolvedURL())
}

// Issue 21: `cleanup --horizon 1ns --inbox-horizon 1ns` deleted everything,
// exit 0. Below the floors it is refused (exit 2) unless
// --allow-short-horizons, which is printed; a run skipped because another
// session holds the retention lock exits 5 naming it.
func TestCleanupFloorAndVisibleSkip(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "recent", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusPublished},
		testdb.SQL("published_at", "now() - interval '1 hour'"))
	exec1(t, s.DB, `INSERT INTO messaging_inbox (message_id, consumer, processed_at) VALUES ('m1', 'billing', now() - interval '1 hour')`)
	for _, args := range [][]string{{"--horizon", "1ns"}, {"--inbox-horizon", "1ns"}, {"--inbox-horizon", "24h"}} {
		r := db(t, s, append([]string{"cleanup"}, args...)...)
		requireCode(t, r, ExitUsage)
		require.Contains(t, r.stderr, "code: RETENTION_HORIZON_BELOW_FLOOR", "%q", args)
		require.Contains(t, r.stderr, "--allow-short-horizons")
	}
	// Zero is not a quiet way back to the default.
	for _, args := range [][]string{{"--horizon", "0"}, {"--horizon", "0s", "--allow-short-horizons"}, {"--batch-size", "0"}, {"--max-batches", "0"}, {"--statement-timeout", "0s"}} {
		r := db(t, s, append([]string{"cleanup"}, args...)...)
		requireCode(t, r, ExitUsage)
		require.Contains(t, r.stderr, "is 0; give a positive value", "%q", args)
	}
	inbox := func() int { return testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_inbox`) }
	require.Equal(t, 1, s.Count(t, ""))
	require.Equal(t, 1, inbox())
	r := db(t, s, "cleanup", "--horizon", "1m", "--inbox-horizon", "1m", "--allow-short-horizons")
	requireCode(t, r, 0)
	require.Contains(t, r.stderr, "warning: --allow-short-horizons: horizon 1m0s")
	require.Zero(t, s.Count(t, ""))
	require.Zero(t, inbox())

	// A login holding the retention lock: the run is skipped, visibly.
	holder, err := s.DB.Conn(context.Background())
	require.NoError(t, err)
	defer holder.Close()
	_, err = holder.ExecContext(context.Background(), `SET application_name = 'lock-squatter'`)
	require.NoError(t, err)
	_, err = holder.ExecContext(context.Background(),
		`SELECT pg_advisory_lock(hashtextextended('watermill-outbox/retention/' || 'messaging_outbox'::regclass::oid::text, 0))`)
	require.NoError(t, err)
	r = db(t, s, "cleanup")
	requireCode(t, r, ExitSkipped)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_CLEANUP_SKIPPED")
	require.Contains(t, r.stderr, "lock-squatter")
	r = db(t, s, "--json", "cleanup")
	requireCode(t, r, ExitSkipped)
	var doc map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &doc))
	require.Equal(t, true, doc["skipped"])
	require.Contains(t, doc["held_by"], "lock-squatter")
}

// README: each relay's MaxAttempts decides, and `outboxctl status` lists the
// live relays' budgets and warns when they differ.
func TestStatusWarnsWhenRelayBudgetsDiffer(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	ctx := context.Background()
	require.NoError(t, relaymode.BeatBudget(ctx, s.DB, "relay-a", time.Minute, 25))
	r := db(t, s, "status")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^relay-a\s+.*\s25$`, r.stdout)
	require.NotContains(t, r.stdout, "different MaxAttempts")

	require.NoError(t, relaymode.BeatBudget(ctx, s.DB, "relay-b", time.Minute, 3))
	r = db(t, s, "status")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^relay-b\s+.*\s3$`, r.stdout)
	require.Contains(t, r.stdout, "warning: live relays have different MaxAttempts")
	r = db(t, s, "--json", "status")
	requireCode(t, r, 0)
	var doc map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &doc))
	require.Equal(t, true, doc["budgets_differ"])
}

// cleanup --archive reports ids already in the archive: the same message
// (a duplicate, archived) and a different one (a conflict, left in the
// outbox), and the run goes on past them.
func TestCleanupArchiveReportsDuplicatesAndConflicts(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertOldPublished(t, s, 5)
	exec1(t, s.DB, `INSERT INTO messaging_outbox_archive (`+envelope.SelectColumns+`)
SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id IN ('old-1', 'old-2')`)
	exec1(t, s.DB, `UPDATE messaging_outbox_archive SET payload = 'other' WHERE message_id = 'old-2'`)
	r := db(t, s, "cleanup", "--archive", "--batch-size", "2", "--horizon", "72h")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^archived\s+4$`, r.stdout)
	require.Regexp(t, `(?m)^archive duplicates\s+1$`, r.stdout)
	require.Regexp(t, `(?m)^archive conflicts\s+1$`, r.stdout)
	require.Equal(t, 1, s.Count(t, "message_id = 'old-2' AND last_failure_code = 'RETENTION_ARCHIVE_CONFLICT'"))
	require.Equal(t, 1, s.Count(t, ""))
}
