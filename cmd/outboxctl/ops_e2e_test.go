package main

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// secret is the password of every DSN below; it must never be printed.
const secret = "S3cretPW"

// Every command, fed a DSN that carries a password (malformed, or
// well-formed but unreachable), through the flag or the environment, in
// human and JSON output, never prints the password; a malformed URL is
// OUTBOXCTL_INVALID_DATABASE_URL, exit 2, whose message quotes no input.
func TestSecretsNeverPrinted(t *testing.T) {
	t.Parallel()
	commands := [][]string{
		{"migrate"},
		{"status"},
		{"inspect", "m-1"},
		{"redrive", "--dry-run"},
		{"purge", "--dry-run"},
		{"redrive", "--ticket", "CHG-1", "--expect-digest", "abc"},
		{"purge", "--ticket", "CHG-1", "--expect-digest", "abc"},
		{"cleanup"},
		{"relay", "--to", "log"},
		{"relay", "--to", "log", "--listen", "--log-format", "json"},
		{"debezium", "status"},
		{"debezium", "enable", "--by", "ops"},
		{"debezium", "disable", "--by", "ops"},
	}
	malformed := []string{
		"postgres://postgres:" + secret + "%Z@127.0.0.1:5432/test",        // a raw '%' in a generated password
		"postgres://postgres:" + secret + "@[::1/test",                    // an IPv6 host without ']'
		"postgresql://postgres:" + secret + "@127.0.0.1:port/test",        // a port that is not a number
		"host=127.0.0.1 password='" + secret + " user=postgres",           // an unterminated quote
		"host=127.0.0.1 password=" + secret + " port=notaport dbname=x",   // a bad port, key=value
		"postgres://u:" + secret + "@127.0.0.1/db?client_encoding=LATIN1", // a parameter lib/pq refuses
		"mysql://u:" + secret + "@127.0.0.1/db",                           // another scheme
	}
	for _, dsn := range malformed {
		for i, args := range commands {
			for _, viaEnv := range []bool{false, true} {
				for _, asJSON := range []bool{false, true} {
					// Every command through the flag in text; the
					// environment and --json with status and the relays
					// (the error path is the same for every command).
					if (viaEnv || asJSON) && i != 1 && args[0] != "relay" {
						continue
					}
					var env []string
					full := args
					if asJSON {
						full = append([]string{"--json"}, full...)
					}
					if viaEnv {
						env = []string{"OUTBOX_DATABASE_URL=" + dsn}
					} else {
						full = append([]string{"--database-url", dsn}, full...)
					}
					r := cli(t, env, full...)
					where := fmt.Sprintf("dsn %q, args %q, env %v", dsn, full, viaEnv)
					require.NotContains(t, r.stdout+r.stderr, secret, where)
					require.Equal(t, 2, r.code, "%s\nstdout:\n%s\nstderr:\n%s", where, r.stdout, r.stderr)
					require.Contains(t, r.stderr, "OUTBOXCTL_INVALID_DATABASE_URL", where)
					require.NotContains(t, r.stderr, "127.0.0.1", where) // no part of the input is quoted
				}
			}
		}
	}

	// Well-formed but unreachable: exit 4, the password masked.
	for _, dsn := range []string{
		"postgres://postgres:" + secret + "@127.0.0.1:1/test?sslmode=disable&connect_timeout=2",
		"host=127.0.0.1 port=1 user=postgres password=" + secret + " sslmode=disable connect_timeout=2",
	} {
		for _, args := range commands {
			r := cli(t, nil, append([]string{"--database-url", dsn}, args...)...)
			require.NotContains(t, r.stdout+r.stderr, secret, "dsn %q args %q", dsn, args)
			require.Equal(t, 4, r.code, "dsn %q args %q\nstderr:\n%s", dsn, args, r.stderr)
			require.Contains(t, r.stderr, "OUTBOXCTL_DATABASE_UNREACHABLE")
		}
	}

	// A broker URL that does not parse: a usage error, its password masked.
	s := newSchema(t)
	for _, asJSON := range []bool{false, true} {
		args := []string{"--database-url", s.URL, "relay", "--to", "amqp", "--amqp-url", "amqp://guest:" + secret + "%Z@127.0.0.1:5672/"}
		if asJSON {
			args = append([]string{"--json"}, args...)
		}
		r := cli(t, nil, args...)
		require.NotContains(t, r.stdout+r.stderr, secret, r.stderr)
		requireCode(t, r, 2)
	}
	// The same through the environment.
	r := cli(t, []string{"OUTBOX_AMQP_URL=amqp://guest:" + secret + "%Z@127.0.0.1:5672/"}, "--database-url", s.URL, "relay", "--to", "amqp")
	require.NotContains(t, r.stdout+r.stderr, secret, r.stderr)
	requireCode(t, r, 2)
	// A NATS URL with a password that cannot be reached (a failed dial,
	// exit 1) or parsed (a refused setting, exit 2, OUTBOX_INVALID_CONFIG).
	for _, tc := range []struct {
		url  string
		exit int
		code string
	}{
		{"nats://u:" + secret + "@127.0.0.1:1", 1, ""},
		{"nats://u:" + secret + "%Z@127.0.0.1:1", 2, "OUTBOX_INVALID_CONFIG"},
	} {
		r = cli(t, nil, "--database-url", s.URL, "--json", "relay", "--to", "nats", "--nats-url", tc.url)
		require.NotContains(t, r.stdout+r.stderr, secret, r.stderr)
		requireCode(t, r, tc.exit)
		if tc.code != "" {
			var e map[string]any
			require.NoError(t, json.Unmarshal([]byte(r.stderr), &e), r.stderr)
			require.Equal(t, tc.code, e["code"])
			require.EqualValues(t, tc.exit, e["exit_code"])
		}
	}
}

// A relay that runs (the test server trusts any password) with a password
// in its URL, LISTENing on it, logging at debug in both formats, never
// prints it.
func TestRelayRunningWithPasswordNeverLogsIt(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "m-1", Destination: "orders", Payload: []byte("x")})
	withPW := strings.Replace(s.URL, "postgres://postgres@", "postgres://postgres:"+secret+"@", 1)
	require.NotEqual(t, s.URL, withPW)
	for _, format := range []string{"text", "json"} {
		p := startRelayProc(t, []string{"OUTBOX_DATABASE_URL=" + withPW}, "relay", "--to", "log", "--listen",
			"--log-level", "debug", "--log-format", format, "--poll-interval", "50ms", "--max-poll-interval", "200ms")
		p.waitLine(t, func(l string) bool { return strings.Contains(l, "Outbox forwarder running") })
		waitStatus(t, s, &syncWriter{}, "m-1", "PUBLISHED")
		require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
		<-p.errEnd
		require.NoError(t, p.cmd.Wait(), p.log.String())
		require.Contains(t, p.log.String(), "stopped")
		require.NotContains(t, p.log.String(), secret)
		exec1(t, s.DB, `UPDATE messaging_outbox SET status = 'PENDING', published_at = NULL WHERE message_id = 'm-1'`)
	}
}

// emptySchemaURL is a URL whose search_path names a schema with no tables.
func emptySchemaURL(t *testing.T) (string, string) {
	t.Helper()
	admin, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	name := fmt.Sprintf("outbox_test_%d_empty%d", time.Now().Unix(), time.Now().UnixNano()%1000000)
	exec1(t, admin, "CREATE SCHEMA "+name)
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA IF EXISTS " + name + " CASCADE") })
	return name, testdb.WithSearchPath(testdb.URL(), name)
}

// Every command that opens the database but migrate, on a search_path with
// no outbox, names the schema and the remedy with OUTBOX_SCHEMA_NOT_MIGRATED
// (exit 2) instead of a raw "relation does not exist". version and debezium
// config open no database: they succeed there (and with no database at all).
func TestEveryCommandNamesUnmigratedSchema(t *testing.T) {
	t.Parallel()
	name, url := emptySchemaURL(t)
	for _, args := range [][]string{
		{"status"},
		{"inspect", "m-1"},
		{"redrive", "--dry-run"},
		{"purge", "--dry-run"},
		{"redrive", "--ticket", "CHG-1", "--expect-digest", "abc"},
		{"cleanup"},
		{"relay", "--to", "log"},
		{"debezium", "status"},
		{"debezium", "enable", "--by", "ops"},
		{"debezium", "disable", "--by", "ops"},
	} {
		for _, asJSON := range []bool{false, true} {
			full := append([]string{"--database-url", url}, args...)
			if asJSON {
				full = append([]string{"--json"}, full...)
			}
			r := cli(t, nil, full...)
			require.Equal(t, 2, r.code, "%q\nstdout:\n%s\nstderr:\n%s", full, r.stdout, r.stderr)
			require.Contains(t, r.stderr, "OUTBOX_SCHEMA_NOT_MIGRATED", "%q", full)
			require.Contains(t, r.stderr, "messaging_outbox not found in search_path", "%q", full)
			require.Contains(t, r.stderr, name, "%q", full)
			require.Contains(t, r.stderr, "run outboxctl migrate", "%q", full)
			require.NotContains(t, r.stderr, "does not exist", "%q", full)
		}
	}
	for _, args := range [][]string{{"version"}, {"debezium", "config"}} {
		requireCode(t, cli(t, nil, append([]string{"--database-url", url}, args...)...), 0)
		requireCode(t, cli(t, nil, append([]string{"--database-url", "postgres://nobody@127.0.0.1:1/none?sslmode=disable"}, args...)...), 0)
	}
	// migrate itself works there, and then status does.
	requireCode(t, cli(t, nil, "--database-url", url, "migrate"), 0)
	requireCode(t, cli(t, nil, "--database-url", url, "status"), 0)
}

// relayProc is a running `outboxctl relay` whose stderr is read line by
// line.
type relayProc struct {
	cmd    *exec.Cmd
	log    *syncBuffer
	lines  chan string
	errEnd chan struct{}
}

func startRelayProc(t *testing.T, env []string, args ...string) *relayProc {
	t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	cmd.Stdout = io.Discard
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	p := &relayProc{cmd: cmd, log: &syncBuffer{}, lines: make(chan string, 1000), errEnd: make(chan struct{})}
	go func() {
		defer close(p.errEnd)
		defer close(p.lines)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.log.WriteString(sc.Text() + "\n")
			select {
			case p.lines <- sc.Text():
			default:
			}
		}
	}()
	return p
}

// waitLine returns the first stderr line for which match is true.
func (p *relayProc) waitLine(t *testing.T, match func(string) bool) string {
	t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		select {
		case l, ok := <-p.lines:
			require.True(t, ok, "relay exited; stderr:\n%s", p.log.String())
			if match(l) {
				return l
			}
		case <-deadline:
			t.Fatalf("no such line; stderr:\n%s", p.log.String())
		}
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// The relay deploys like a service: every flag from OUTBOX_* (a flag on the
// command line wins), JSON logs, /healthz and /readyz on the metrics
// listener, /readyz failing with the check that fails.
func TestRelayServiceEnvHealthReadyAndJSONLogs(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	env := []string{
		"OUTBOX_DATABASE_URL=" + s.URL,
		"OUTBOX_TO=log",
		"OUTBOX_METRICS_ADDR=127.0.0.1:0",
		"OUTBOX_LOG_FORMAT=json",
		"OUTBOX_LOG_LEVEL=info",
		"OUTBOX_OWNER=owner-from-env",
		"OUTBOX_POLL_INTERVAL=50ms",
		"OUTBOX_MAX_POLL_INTERVAL=200ms",
		"OUTBOX_HEARTBEAT_INTERVAL=1h", // one beat at start: the test removes it below
	}
	p := startRelayProc(t, env, "relay", "--owner", "owner-from-flag")

	// Every stderr line is a JSON object; the start lines carry the owner
	// the flag gave, not the environment's.
	var metrics string
	started := p.waitLine(t, func(l string) bool { return strings.Contains(l, "publishing to log") })
	var rec map[string]any
	require.NoError(t, json.Unmarshal([]byte(started), &rec), started)
	require.Equal(t, "owner-from-flag", rec["owner"])
	require.Equal(t, "INFO", rec["level"])
	for _, l := range strings.Split(strings.TrimSpace(p.log.String()), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &m), "not a JSON log line: %q", l)
		if msg, _ := m["msg"].(string); strings.HasPrefix(msg, "metrics on ") {
			metrics = strings.TrimSuffix(strings.TrimPrefix(msg, "metrics on "), "/metrics")
		}
	}
	require.NotEmpty(t, metrics, p.log.String())

	code, body := get(t, metrics+"/healthz")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok\n", body)

	// Ready once the first heartbeat is in (Run beats before its first pass,
	// and the start line above is logged before Run).
	require.Eventually(t, func() bool { c, _ := get(t, metrics+"/readyz"); return c == http.StatusOK },
		30*time.Second, 20*time.Millisecond, p.log.String())
	_, body = get(t, metrics+"/readyz")
	require.Contains(t, body, `"ready":true`)
	require.Contains(t, body, `"owner":"owner-from-flag"`)

	// Without its heartbeat the relay is not ready, and says why.
	require.NoError(t, relaymode.Leave(context.Background(), s.DB, "owner-from-flag"))
	code, body = get(t, metrics+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code, body)
	require.Contains(t, body, `"name":"heartbeat","ok":false`)
	require.Contains(t, body, "no live heartbeat of relay owner-from-flag")

	code, body = get(t, metrics+"/metrics")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "outbox_oldest_pending_age_seconds")

	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	<-p.errEnd
	require.NoError(t, p.cmd.Wait(), p.log.String())
	require.Contains(t, p.log.String(), `"msg":"relay owner-from-flag stopped"`)
}

// A value from the environment that does not parse is a usage error naming
// the variable and not quoting the value; an unknown log format or level is
// refused the same way.
func TestRelayEnvAndLogFlagErrors(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	r := cli(t, []string{"OUTBOX_BATCH_SIZE=many" + secret}, "--database-url", s.URL, "relay", "--to", "log")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "OUTBOX_BATCH_SIZE is not a valid value for --batch-size")
	require.NotContains(t, r.stderr, secret)

	r = cli(t, nil, "--database-url", s.URL, "relay", "--to", "log", "--log-format", "xml")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "--log-format")
	r = cli(t, []string{"OUTBOX_LOG_LEVEL=loud"}, "--database-url", s.URL, "relay", "--to", "log")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "--log-level")

	// The help names each flag's variable.
	r = cli(t, nil, "relay", "--help")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "[$OUTBOX_MAX_ATTEMPTS]")
	require.Contains(t, r.stdout, "/readyz")
	require.Contains(t, r.stdout, "terminationGracePeriodSeconds")
}

func TestVersionFromBuildInfo(t *testing.T) {
	t.Parallel()
	r := cli(t, nil, "--json", "version")
	requireCode(t, r, 0)
	var v buildInfo
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v), r.stdout)
	require.Equal(t, "github.com/fencedoutbox/watermill-outbox/cmd/outboxctl", v.Module)
	require.True(t, strings.HasPrefix(v.GoVersion, "go"), v.GoVersion)
	require.NotEmpty(t, v.Version)
	r = cli(t, nil, "version")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^go\s+go1\.`, r.stdout)
}

// cobra's own refusals carry OUTBOXCTL_USAGE like the CLI's, in JSON too.
func TestCommandLineErrorsHaveUsageCode(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"--json", "status", "--no-such-flag"}, {"--json", "migrate", "extra-arg"}, {"--json", "status", "--max-stuck", "many"},
		// cobra refuses these before it has parsed --json: an unknown
		// command, and a bad flag ahead of --json.
		{"--json", "no-such-command"}, {"status", "--no-such-flag", "--json"}} {
		r := cli(t, nil, args...)
		requireCode(t, r, ExitUsage)
		var e map[string]any
		require.NoError(t, json.Unmarshal([]byte(r.stderr), &e), r.stderr)
		require.Equal(t, "OUTBOXCTL_USAGE", e["code"], "%q", args)
	}
	r := cli(t, nil, "status", "--no-such-flag")
	requireCode(t, r, ExitUsage)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_USAGE")
	require.Contains(t, r.stderr, "Run 'outboxctl --help' for usage.")
}

// The database URL, and every relay setting, can come from a file named by
// the variable + _FILE (a mounted secret); an unreadable file is a usage
// error naming the variable and the path.
func TestSettingsFromFiles(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	dir := t.TempDir()
	urlFile := dir + "/database-url"
	require.NoError(t, os.WriteFile(urlFile, []byte(s.URL+"\n"), 0o600))
	r := cli(t, []string{"OUTBOX_DATABASE_URL_FILE=" + urlFile}, "status")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "relay mode:")

	r = cli(t, []string{"OUTBOX_DATABASE_URL_FILE=" + dir + "/missing"}, "status")
	requireCode(t, r, ExitUsage)
	require.Contains(t, r.stderr, "OUTBOX_DATABASE_URL_FILE names "+dir+"/missing, which cannot be read")

	// The variable wins over its file; a relay flag from a file.
	ownerFile := dir + "/owner"
	require.NoError(t, os.WriteFile(ownerFile, []byte("owner-from-file\n"), 0o600))
	cmd := relayFlagSet(t)
	env := map[string]string{"OUTBOX_OWNER_FILE": ownerFile, "OUTBOX_TO": "log", "OUTBOX_TO_FILE": dir + "/missing"}
	require.NoError(t, bindEnv(cmd, func(k string) string { return env[k] }))
	owner, err := cmd.Flags().GetString("owner")
	require.NoError(t, err)
	require.Equal(t, "owner-from-file", owner)
	to, err := cmd.Flags().GetString("to")
	require.NoError(t, err)
	require.Equal(t, "log", to)
}
