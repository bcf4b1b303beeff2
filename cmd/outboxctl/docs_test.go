package main

import (
	"bytes"
	"context"
	"database/sql"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

var updateDocs = flag.Bool("update-docs", false, "rewrite the generated transcripts of docs/OPERATIONS.md from what the commands print")

// operationsPath holds the runbook and the hand-redrive SQL; readmePath
// and the docs/ directory hold the links TestDocLinksExist follows.
const (
	operationsPath = "../../docs/OPERATIONS.md"
	readmePath     = "../../README.md"
)

// runbook writes a transcript: each command as "$ outboxctl ...", then what
// it printed on stdout and stderr in the order it printed it, then
// "[exit N]" when N is not 0. Commands run in this process through run(),
// against a schema of their own reached through OUTBOX_DATABASE_URL.
type runbook struct {
	t      *testing.T
	url    string
	schema string
	out    strings.Builder
}

// syncBuf is one ordered stream for a command's stdout and stderr, as a
// terminal shows them.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
	on func(string) // called with the whole text after each write
}

func (w *syncBuf) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b.Write(p)
	if w.on != nil {
		w.on(w.b.String())
	}
	return len(p), nil
}

func (w *syncBuf) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

func (r *runbook) getenv(k string) string {
	if k == "OUTBOX_DATABASE_URL" {
		return r.url
	}
	return ""
}

func (r *runbook) comment(lines ...string) {
	if r.out.Len() > 0 {
		r.out.WriteString("\n")
	}
	for _, l := range lines {
		r.out.WriteString(strings.TrimSpace("# "+l) + "\n")
	}
}

func (r *runbook) line(s string) { r.out.WriteString(s + "\n") }

// run runs outboxctl args, cancelled when cutAt appears in its output
// ("" = never), and records it; note is appended to the command line as a
// shell comment.
func (r *runbook) run(note, cutAt string, args ...string) (int, string) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w := &syncBuf{}
	if cutAt != "" {
		w.on = func(s string) {
			if strings.Contains(s, cutAt) {
				cancel()
			}
		}
	}
	code := run(ctx, args, w, w, r.getenv)
	cmd := "$ outboxctl " + strings.Join(quoteAll(args), " ")
	if note != "" {
		cmd += "   # " + note
	}
	r.line(cmd)
	r.out.WriteString(w.String())
	if code != 0 {
		r.line(fmt.Sprintf("[exit %d]", code))
	}
	return code, w.String()
}

func quoteAll(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = shellQuote(a)
	}
	return out
}

// Normalizations applied to both the runbook and a fresh transcript before
// they are compared: what changes from run to run (clocks, ages, the OS
// user and host in a default journal owner, the schema and the port) and
// nothing else.
var transcriptNormal = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)`), "<time>"},
	{regexp.MustCompile(`\b(\d+h)?(\d+m)?\d+(\.\d+)?(s|ms|µs|ns)\b`), "<duration>"},
	{regexp.MustCompile(`outboxctl:[^\s@]+@[^\s:]+:`), "outboxctl:<user>@<host>:"},
}

func normalizeTranscript(s string) string {
	for _, n := range transcriptNormal {
		s = n.re.ReplaceAllString(s, n.with)
	}
	return strings.TrimSpace(s)
}

const (
	runbookBegin = "<!-- BEGIN generated runbook: TestRunbook writes this block (go test ./cmd/outboxctl -run TestRunbook -update-docs) and fails when the commands print anything else -->"
	runbookEnd   = "<!-- END generated runbook -->"
)

// TestRunbook runs the operator runbook of docs/OPERATIONS.md end to end — an
// unmigrated schema, migrate, a relay with its health probes, status,
// inspect, a dry run, an approved redrive, a purge cut mid-way and resumed,
// retention — and requires the runbook's transcript to be what the commands
// print (up to clocks, ages and the operator's user and host).
func TestRunbook(t *testing.T) {
	name, url := emptySchemaURL(t)
	r := &runbook{t: t, url: url, schema: name}

	r.comment("The database: a URL in the environment (flags show in ps). search_path selects the schema.",
		"export OUTBOX_DATABASE_URL='postgres://outbox_ops@db.internal:5432/app?sslmode=verify-full&search_path=shop'",
		"",
		"1. Nothing works on an unmigrated schema; every command that opens the database says what to do.")
	r.run("", "", "status")
	r.run("", "", "migrate")

	// The application writes rows (here: by SQL, as a backlog with history).
	db, err := sql.Open("postgres", url)
	require.NoError(t, err)
	defer db.Close()
	ago := func(column, interval string) testdb.RowOption {
		return testdb.SQL(column, "now() - interval '"+interval+"'")
	}
	evt := func(n int, dest, payload, tenant string) envelope.Row {
		return envelope.Row{MessageID: fmt.Sprintf("evt-%d", n), Destination: dest, Payload: []byte(payload),
			Tenant: tenant, CorrelationID: fmt.Sprintf("req-%d", n)}
	}
	parked := func(r envelope.Row, st envelope.Status, attempts int, code, detail string) envelope.Row {
		r.Status, r.Attempts, r.LastFailureCode, r.LastFailureDetail = st, attempts, code, detail
		return r
	}
	const notFound, timeout = "topic billing.invoiced not found", "publish did not return within 5s"
	testdb.InsertRows(t, db,
		testdb.Row(evt(1, "orders.placed", `{"order":1}`, "acme"), ago("created_at", "20 minutes")),
		testdb.Row(evt(2, "orders.placed", `{"order":2}`, "globex"), ago("created_at", "19 minutes")),
		testdb.Row(evt(3, "billing.invoiced", `{"invoice":3}`, "acme"), ago("created_at", "18 minutes")),
		testdb.Row(parked(evt(4, "billing.invoiced", `{"invoice":4}`, "acme"), envelope.StatusFailed, 1, "PUBSUB_TOPIC_NOT_FOUND", notFound),
			ago("created_at", "17 minutes"), ago("parked_at", "16 minutes")),
		testdb.Row(parked(evt(5, "billing.invoiced", `{"invoice":5}`, "globex"), envelope.StatusFailed, 1, "PUBSUB_TOPIC_NOT_FOUND", notFound),
			ago("created_at", "16 minutes"), ago("parked_at", "15 minutes")),
		testdb.Row(parked(evt(6, "billing.invoiced", `{"invoice":6}`, "globex"), envelope.StatusFailed, 1, "PUBSUB_TOPIC_NOT_FOUND", notFound),
			ago("created_at", "15 minutes"), ago("parked_at", "14 minutes")),
		testdb.Row(parked(evt(7, "orders.placed", `{"order":7}`, "acme"), envelope.StatusExhausted, 10, "PUBLISH_TIMEOUT", timeout),
			ago("created_at", "14 minutes"), ago("parked_at", "5 minutes")),
		testdb.Row(parked(evt(8, "orders.placed", `{"order":8}`, "globex"), envelope.StatusExhausted, 10, "PUBLISH_TIMEOUT", timeout),
			ago("created_at", "13 minutes"), ago("parked_at", "4 minutes")),
	)
	var history []testdb.OutboxRow
	for g := 1; g <= 5; g++ {
		history = append(history, testdb.Row(envelope.Row{MessageID: fmt.Sprintf("old-%d", g), Destination: "orders.placed",
			Payload: []byte("{}"), Status: envelope.StatusPublished}, ago("created_at", "5 days"), ago("published_at", "4 days")))
	}
	testdb.InsertRows(t, db, history...)

	r.comment("2. A relay: JSON logs on stderr, messages on stdout (--to log), /healthz and /readyz beside /metrics.",
		"Kubernetes and systemd examples: deploy/. Every flag is also an OUTBOX_* variable.")
	r.relay()

	r.comment("3. What is stuck, and why.")
	r.run("", "", "status")
	r.run("", "", "inspect", "evt-4")

	r.comment("4. Plan, approve, execute. The dry run changes nothing and prints the plan's digest;",
		"the approver records the approval of that digest under a ticket in the database (the approver",
		"is the database login; the rows matching now, and their count, are all it approves);",
		"execution needs the ticket, the digest and that approval.")
	filter := []string{"--status", "failed", "--failure-code", "PUBSUB_TOPIC_NOT_FOUND"}
	_, out := r.run("", "", append([]string{"redrive"}, append(filter, "--dry-run")...)...)
	digest := digestRe.FindStringSubmatch(out)
	require.NotNil(t, digest, out)
	r.run("", "", append([]string{"redrive"}, append(filter, "--ticket", "CHG-1042")...)...)
	r.run("not approved yet", "", append([]string{"redrive"}, append(filter, "--ticket", "CHG-1042", "--expect-digest", digest[1])...)...)
	r.run("the approver", "", append([]string{"redrive"}, append(filter, "--ticket", "CHG-1042", "--expect-digest", digest[1], "--approve")...)...)
	r.run("", "", append([]string{"redrive"}, append(filter, "--ticket", "CHG-1042", "--expect-digest", digest[1])...)...)
	r.run("the same approval never runs twice", "", append([]string{"redrive"}, append(filter, "--ticket", "CHG-1042", "--expect-digest", digest[1])...)...)

	r.comment("5. An execution cut half-way (Ctrl-C, a lost connection) says how to resume; one killed",
		"(kill -9, an evicted pod) prints nothing, and the same command resumes it. The same operator",
		"resumes at once (the default owner is per operator and ticket); anyone else after the lease.",
		"A frozen executor (a stopped process, a partition) has its batch ended by the server after a",
		"lease idle; a row another session keeps locked fails the batch after half the lease (resumable).")
	_, out = r.run("", "", "purge", "--status", "exhausted", "--dry-run")
	pd := digestRe.FindStringSubmatch(out)
	require.NotNil(t, pd, out)
	r.run("the approver", "", "purge", "--status", "exhausted", "--ticket", "CHG-1043", "--expect-digest", pd[1], "--approve")
	_, out = r.run("Ctrl-C after the first batch", "batch 1 committed", "purge", "--status", "exhausted", "--batch-size", "1", "--ticket", "CHG-1043", "--expect-digest", pd[1])
	resume := resumeRe.FindStringSubmatch(out)
	require.NotNil(t, resume, out)
	r.run("another operator, while the lease lives", "", "purge", "--status", "exhausted", "--batch-size", "1", "--ticket", "CHG-1043", "--expect-digest", pd[1], "--owner", "ops-bob")
	require.Contains(t, resume[1], "--owner outboxctl:")
	r.run("the same operator, the same command", "", "purge", "--status", "exhausted", "--batch-size", "1", "--ticket", "CHG-1043", "--expect-digest", pd[1])

	r.comment("6. Retention: published rows past the horizon, in bounded batches.")
	r.run("", "", "cleanup", "--horizon", "72h", "--batch-size", "2")

	got := strings.ReplaceAll(r.out.String(), name, "shop")
	readme, err := os.ReadFile(operationsPath)
	require.NoError(t, err)
	begin := bytes.Index(readme, []byte(runbookBegin))
	end := bytes.Index(readme, []byte(runbookEnd))
	require.True(t, begin >= 0 && end > begin, "docs/OPERATIONS.md has no generated runbook block (%q ... %q)", runbookBegin, runbookEnd)
	block := string(readme[begin+len(runbookBegin) : end])
	block = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(block), "```console"), "```")
	if *updateDocs && normalizeTranscript(got) != normalizeTranscript(block) {
		// Rewritten only when it differs beyond clocks and ages, so that
		// an update run leaves an unchanged transcript alone.
		fresh := string(readme[:begin+len(runbookBegin)]) + "\n```console\n" + got + "```\n" + string(readme[end:])
		require.NoError(t, os.WriteFile(operationsPath, []byte(fresh), 0o644))
		return
	}
	require.Equal(t, normalizeTranscript(got), normalizeTranscript(block),
		"docs/OPERATIONS.md's runbook is not what the commands print; rerun with -update-docs and review the diff")
}

// relay records a relay's start, its probes, the drain of the backlog and
// its stop on SIGTERM.
func (r *runbook) relay() {
	t := r.t
	t.Helper()
	args := []string{"relay", "--to", "log", "--owner", "relay-1", "--metrics-addr", "127.0.0.1:0", "--log-format", "json"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &syncBuf{}
	var stdout syncBuf
	done := make(chan int, 1)
	go func() { done <- run(ctx, args, &stdout, stderr, r.getenv) }()

	waitFor := func(what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for !ok() {
			select {
			case code := <-done:
				t.Fatalf("relay exited %d before %s:\n%s", code, what, stderr.String())
			case <-time.After(20 * time.Millisecond):
			}
			require.True(t, time.Now().Before(deadline), "no %s; stderr:\n%s", what, stderr.String())
		}
	}
	waitFor("start", func() bool { return strings.Contains(stderr.String(), `"msg":"Outbox forwarder running"`) })
	port := regexp.MustCompile(`http://127\.0\.0\.1:(\d+)/metrics`).FindStringSubmatch(stderr.String())
	require.NotNil(t, port, stderr.String())
	base := "http://127.0.0.1:" + port[1]
	fixPort := func(s string) string { return strings.ReplaceAll(s, "127.0.0.1:"+port[1], "127.0.0.1:9464") }

	shown := []string{"relay", "--to", "log", "--owner", "relay-1", "--metrics-addr", "127.0.0.1:9464", "--log-format", "json"}
	r.line("$ outboxctl " + strings.Join(shown, " ") + " >messages.jsonl &")
	started := stderr.String()
	r.out.WriteString(fixPort(started))

	_, body := get(t, base+"/healthz")
	r.line("$ curl -s 127.0.0.1:9464/healthz")
	r.out.WriteString(body)
	waitFor("readiness", func() bool { c, _ := get(t, base+"/readyz"); return c == 200 })
	_, body = get(t, base+"/readyz")
	r.line("$ curl -s 127.0.0.1:9464/readyz")
	r.out.WriteString(body)

	db, err := sql.Open("postgres", r.url)
	require.NoError(t, err)
	defer db.Close()
	waitFor("the pending rows published", func() bool {
		return testdb.QueryInt(t, db, `SELECT count(*) FROM messaging_outbox WHERE message_id IN ('evt-1','evt-2','evt-3') AND status = 'PUBLISHED'`) == 3
	})
	waitFor("three messages on stdout", func() bool { return strings.Count(stdout.String(), "\n") == 3 })
	r.line("$ wc -l <messages.jsonl")
	r.line("3")
	r.line("$ kill -TERM %1   # drains: publishes in flight finish, outcomes are written, exit 0")
	cancel()
	code := <-done
	require.Equal(t, 0, code, stderr.String())
	r.out.WriteString(fixPort(strings.TrimPrefix(stderr.String(), started)))
}

// The hand-redrive statement of docs/OPERATIONS.md, run on a row EXHAUSTED at its
// budget, makes a relay publish it (without the attempts reset the next
// claim parks it again, BUDGET_SPENT).
func TestHandRedriveSQL(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile(operationsPath)
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)<!-- hand-redrive SQL:[^>]*-->\\s*```sql\\n(.*?)```").FindSubmatch(readme)
	require.NotNil(t, m, "docs/OPERATIONS.md has no hand-redrive SQL block")
	stmt := string(m[1])
	require.Contains(t, stmt, "'evt-7'")

	s := newSchema(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "evt-7", Destination: "orders", Payload: []byte("x"),
		Status: envelope.StatusExhausted, Attempts: 10, LastFailureCode: "PUBLISH_TIMEOUT"})
	exec1(t, s.DB, stmt)
	require.Equal(t, 1, s.Count(t, "message_id = 'evt-7' AND status = 'PENDING'"))

	cmd, stderr := startRelay(t, s, nil, "--to", "log", "--max-attempts", "10")
	// Wait for the row to leave PENDING/IN_FLIGHT, whatever it becomes.
	require.Eventually(t, func() bool {
		return s.Count(t, "message_id = 'evt-7' AND status NOT IN ('PENDING', 'IN_FLIGHT')") == 1
	}, 45*time.Second, 20*time.Millisecond, "stderr:\n%s", stderr.String())
	require.Equal(t, "status=PUBLISHED code=PUBLISH_TIMEOUT detail=<nil>", rowState(t, s, "evt-7"))
	stopRelay(t, cmd, stderr)
}

// Every relative link and file path the README and the documents in docs/
// name exists (a link relative to the file that holds it).
func TestDocLinksExist(t *testing.T) {
	t.Parallel()
	docs, err := filepath.Glob("../../docs/*.md")
	require.NoError(t, err)
	require.NotEmpty(t, docs)
	for _, path := range append([]string{readmePath}, docs...) {
		checkDocLinks(t, path)
	}
}

func checkDocLinks(t *testing.T, path string) {
	t.Helper()
	name := strings.TrimPrefix(path, "../../")
	readme, err := os.ReadFile(path)
	require.NoError(t, err)
	links := regexp.MustCompile(`\]\(([^)#\s]+)(#[^)]*)?\)`).FindAllSubmatch(readme, -1)
	if path == readmePath {
		require.NotEmpty(t, links)
	}
	for _, l := range links {
		target := string(l[1])
		if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
			continue
		}
		_, err := os.Stat(filepath.Join(filepath.Dir(path), target))
		require.NoError(t, err, "%s links to %s, which does not exist", name, target)
	}
	// Named documents too, linked or not.
	for _, doc := range regexp.MustCompile(`\b[A-Z][A-Z_]+\.md\b`).FindAll(readme, -1) {
		found := false
		for _, dir := range []string{"../../", "../../docs/", "../../status/"} {
			if _, err := os.Stat(dir + string(doc)); err == nil {
				found = true
			}
		}
		require.True(t, found, "%s names %s, which is not in the repository", name, doc)
	}
}
