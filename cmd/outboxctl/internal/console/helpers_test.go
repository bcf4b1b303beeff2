package console

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	neturl "net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The grants of docs/SECURITY.md the console's logins hold: every person
// reads what status and inspect read (the reader block), and the approver
// and the operator hold their own block on top.
var (
	readerGrants = append(append([]string{}, readerGrantsWithoutLanes...),
		// status.CollectWith reads the lanes since migration 00050.
		`GRANT SELECT ON messaging_relay_lane, messaging_relay_lane_held TO %[1]s`)
	readerGrantsWithoutLanes = []string{
		`GRANT SELECT ON messaging_schema_version, messaging_outbox, messaging_relay_mode,
    messaging_relay_heartbeat, messaging_relay_breaker, messaging_cdc_slot TO %[1]s`,
	}
	approverGrants = append(append([]string{}, readerGrants...),
		`GRANT SELECT, INSERT ON messaging_admin_approval TO %[1]s`)
	operatorGrants = append(append([]string{}, readerGrants...),
		`GRANT SELECT, UPDATE, DELETE ON messaging_outbox TO %[1]s`,
		`GRANT SELECT, INSERT, UPDATE ON messaging_admin_operation TO %[1]s`,
		`GRANT SELECT ON messaging_admin_approval TO %[1]s`)
)

// Passwords the tests sign in with: the server trusts loopback logins, so
// it does not check them, but the console handles them as it would real
// ones, and TestNoSecretInAnyResponseOrLog looks for them everywhere.
const (
	operatorPassword = "Op3rator-S3cret-7d1f"
	approverPassword = "Appr0ver-S3cret-91ac"
	basePassword     = "Base-URL-S3cret-55e0" // in the configured URL: never used, never shown
)

// clock is a settable clock for sessions and the rate limit.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

type env struct {
	t        testing.TB
	s        *testdb.Schema
	srv      *Server
	ts       *httptest.Server
	clock    *clock
	log      *syncBuffer
	operator string
	approver string
	bodies   *syncBuffer // every response body any client read
}

// newEnv starts a console on a fresh schema with an operator and an
// approver login. cfg's DatabaseURL, Now and Logger are set here.
func newEnv(t testing.TB, cfg Config) *env {
	t.Helper()
	return newEnvOn(t, testdb.New(t), cfg)
}

// newEnvOn is newEnv on an existing schema (read-only mode needs the
// reader's pool before the console starts).
func newEnvOn(t testing.TB, s *testdb.Schema, cfg Config) *env {
	t.Helper()
	e := &env{t: t, s: s, clock: &clock{now: time.Now().UTC()}, log: &syncBuffer{}, bodies: &syncBuffer{}}
	e.operator, _ = s.Role(t, operatorGrants...)
	e.approver, _ = s.Role(t, approverGrants...)
	for role, pw := range map[string]string{e.operator: operatorPassword, e.approver: approverPassword} {
		_, err := s.DB.Exec(fmt.Sprintf("ALTER ROLE %s PASSWORD '%s'", role, pw))
		require.NoError(t, err)
	}
	u, err := neturl.Parse(s.URL)
	require.NoError(t, err)
	u.User = neturl.UserPassword("postgres", basePassword)
	if cfg.ReadOnlyDB == nil {
		cfg.DatabaseURL = u.String()
	}
	cfg.Now = e.clock.Now
	cfg.Logger = slog.New(slog.NewTextHandler(e.log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e.srv, err = New(cfg)
	require.NoError(t, err)
	e.ts = httptest.NewServer(e.srv)
	t.Cleanup(func() {
		e.ts.Close()
		require.NoError(t, e.srv.Close())
	})
	return e
}

// client is one browser: its own cookie jar, redirects not followed (the
// tests look at each answer).
type client struct {
	e    *env
	http *http.Client
	csrf string
}

func (e *env) client() *client {
	jar, err := cookiejar.New(nil)
	require.NoError(e.t, err)
	return &client{e: e, http: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

type answer struct {
	status int
	header http.Header
	body   string
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func (c *client) do(req *http.Request) answer {
	c.e.t.Helper()
	resp, err := c.http.Do(req)
	require.NoError(c.e.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(c.e.t, err)
	c.e.bodies.Write(b)
	for k, vs := range resp.Header {
		fmt.Fprintf(c.e.bodies, "%s: %s\n", k, strings.Join(vs, ", "))
	}
	if m := csrfRE.FindSubmatch(b); m != nil {
		c.csrf = string(m[1])
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

func (c *client) get(path string) answer {
	c.e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, c.e.ts.URL+path, nil)
	require.NoError(c.e.t, err)
	return c.do(req)
}

// post sends form with the client's last seen CSRF token unless form sets
// "csrf" itself.
func (c *client) post(path string, form neturl.Values) answer {
	c.e.t.Helper()
	if form == nil {
		form = neturl.Values{}
	}
	if _, ok := form["csrf"]; !ok {
		form.Set("csrf", c.csrf)
	}
	req, err := http.NewRequest(http.MethodPost, c.e.ts.URL+path, strings.NewReader(form.Encode()))
	require.NoError(c.e.t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	return c.do(req)
}

// signIn signs in through the form and returns the answer to the POST.
func (c *client) signIn(login, password string) answer {
	c.e.t.Helper()
	c.get("/signin")
	return c.post("/signin", neturl.Values{"login": {login}, "password": {password}})
}

func (c *client) mustSignIn(login, password string) {
	c.e.t.Helper()
	a := c.signIn(login, password)
	require.Equal(c.e.t, http.StatusSeeOther, a.status, a.body)
	c.get("/") // picks up the session's CSRF token
}

// wait returns when the console's execution of ticket has returned.
func (e *env) wait(ticket string) {
	e.t.Helper()
	e.srv.mu.Lock()
	ex := e.srv.runs[ticket]
	e.srv.mu.Unlock()
	require.NotNil(e.t, ex, "no execution of %s", ticket)
	select {
	case <-ex.done:
	case <-time.After(time.Minute):
		e.t.Fatalf("execution of %s did not return", ticket)
	}
}

var ticketRE = regexp.MustCompile(`/ops/ticket\?t=(console-[0-9]{8}-[0-9a-f]{8})`)

// ticketOf returns the ticket a plan's redirect names.
func ticketOf(t testing.TB, a answer) string {
	t.Helper()
	m := ticketRE.FindStringSubmatch(a.header.Get("Location"))
	require.NotNil(t, m, "plan redirect: %d %s", a.status, a.header.Get("Location"))
	return m[1]
}

// park inserts n parked rows of destination dest with failure code code.
func (e *env) park(n int, status, dest, code string) {
	e.t.Helper()
	_, err := e.s.DB.ExecContext(context.Background(), `
INSERT INTO messaging_outbox (message_id, destination, payload, status, attempts, parked_at, last_failure_code, tenant)
SELECT $1 || '-' || g, $2, convert_to('{"n":' || g || '}', 'UTF8'), $3, 5, now(), $4, 't' || (g % 3)
  FROM generate_series(1, $5::int) g`, dest+"-"+code, dest, status, code, n)
	require.NoError(e.t, err)
}
