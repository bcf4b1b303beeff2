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
