package console

import (
	"context"
	"database/sql"
	"net/http"
	neturl "net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/leakcheck"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func TestConfigRefusals(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{DatabaseURL: "host=localhost user=x password=pw"},
		{DatabaseURL: "mysql://localhost/x"},
		{DatabaseURL: "postgres://localhost/x", IdleTimeout: -1},
		{DatabaseURL: "postgres://localhost/x", PageSize: 5000},
	} {
		_, err := New(cfg)
		require.ErrorIs(t, err, &outbox.Error{Code: CodeInvalidConfig}, "%+v", cfg)
		require.NotContains(t, err.Error(), "pw")
	}
}

func TestEveryAnswerCarriesTheCSPAndPagesNeedASession(t *testing.T) {
	e := newEnv(t, Config{})
	c := e.client()
	for _, path := range []string{"/signin", "/", "/parked", "/row?id=x", "/relays", "/ops", "/static/console.css", "/nope"} {
		a := c.get(path)
		require.Equal(t, ContentSecurityPolicy, a.header.Get("Content-Security-Policy"), path)
		require.Contains(t, a.header.Get("Content-Security-Policy"), "default-src 'self'")
		require.NotContains(t, a.header.Get("Content-Security-Policy"), "unsafe-inline")
		require.Equal(t, "nosniff", a.header.Get("X-Content-Type-Options"), path)
		require.Equal(t, "DENY", a.header.Get("X-Frame-Options"), path)
		switch path {
		case "/signin", "/static/console.css":
			require.Equal(t, http.StatusOK, a.status, path)
		case "/nope":
			require.Equal(t, http.StatusNotFound, a.status)
		default:
			require.Equal(t, http.StatusSeeOther, a.status, path)
			require.Equal(t, "/signin", a.header.Get("Location"), path)
		}
	}
	// No page carries an inline script or style, or anything from elsewhere.
	c.mustSignIn(e.operator, operatorPassword)
	e.park(3, "FAILED", "orders", "BROKER_DOWN")
	for _, path := range []string{"/", "/parked", "/relays", "/ops", "/row?id=orders-BROKER_DOWN-1"} {
		a := c.get(path)
		require.Equal(t, http.StatusOK, a.status, path)
		require.NotContains(t, a.body, "<script", path)
		require.NotContains(t, a.body, "style=", path)
		require.NotRegexp(t, `(src|href)="(https?:)?//`, a.body, path)
	}
}

func TestSignInCookiesAndTheSessionsLogin(t *testing.T) {
	e := newEnv(t, Config{})
	c := e.client()
	a := c.signIn(e.operator, operatorPassword)
	require.Equal(t, http.StatusSeeOther, a.status, a.body)
	var session *http.Cookie
	for _, ck := range (&http.Response{Header: a.header}).Cookies() {
		if ck.Name == sessionCookie && ck.Value != "" {
			session = ck
		}
	}
	require.NotNil(t, session)
	require.True(t, session.HttpOnly)
	require.Equal(t, http.SameSiteStrictMode, session.SameSite)
	require.False(t, session.Secure, "plain HTTP: a Secure cookie would never come back")
	a = c.get("/")
	require.Equal(t, http.StatusOK, a.status)
	require.Contains(t, a.body, `<b id="login">`+e.operator+`</b>`, "the login is the database's session_user")
	require.Equal(t, 1, e.srv.Sessions())

	c.mustSignIn(e.approver, approverPassword)
	require.Equal(t, 1, e.srv.Sessions(), "a sign-in ends the browser's previous session")
	require.Contains(t, c.get("/").body, `<b id="login">`+e.approver+`</b>`)

	c.post("/signout", nil)
	require.Equal(t, 0, e.srv.Sessions(), "sign-out ends the session and closes its pool")
	require.Equal(t, http.StatusSeeOther, c.get("/").status)
}

func TestCookiesAreSecureUnderTLS(t *testing.T) {
	e := newEnv(t, Config{Secure: true})
	c := e.client()
	a := c.get("/signin")
	require.Contains(t, a.header.Get("Set-Cookie"), "Secure")
	require.Contains(t, a.header.Get("Set-Cookie"), "HttpOnly")
	require.Contains(t, a.header.Get("Set-Cookie"), "SameSite=Strict")
	require.NotEmpty(t, a.header.Get("Strict-Transport-Security"))
}

func TestStateChangingRequestsWithoutTheCSRFTokenAreRefused(t *testing.T) {
	e := newEnv(t, Config{})
	e.park(4, "FAILED", "orders", "BROKER_DOWN")
	c := e.client()

	// The sign-in form's own token.
	c.get("/signin")
	a := c.post("/signin", neturl.Values{"login": {e.operator}, "password": {operatorPassword}, "csrf": {"forged"}})
	require.Equal(t, http.StatusForbidden, a.status)
	require.Contains(t, a.body, string(CodeCSRF))
	require.Equal(t, 0, e.srv.Sessions())

	c.mustSignIn(e.operator, operatorPassword)
	plan := neturl.Values{"op": {"redrive"}, "code": {"BROKER_DOWN"}}
	for name, token := range map[string][]string{"missing": nil, "empty": {""}, "another": {flip(c.csrf)}} {
		form := neturl.Values{}
		for k, v := range plan {
			form[k] = v
		}
		if token != nil {
			form["csrf"] = token
		} else {
			form["csrf"] = []string{""}
		}
		a := c.post("/plan", form)
		require.Equal(t, http.StatusForbidden, a.status, name)
		require.Contains(t, a.body, string(CodeCSRF), name)
	}
	// Another origin, with the right token.
	form := neturl.Values{"op": {"redrive"}, "code": {"BROKER_DOWN"}, "csrf": {c.csrf}}
	req, err := http.NewRequest(http.MethodPost, e.ts.URL+"/plan", strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "https://evil.example")
	a = c.do(req)
	require.Equal(t, http.StatusForbidden, a.status)
	require.Contains(t, a.body, string(CodeCSRF))
	// Sign-out is state-changing too.
	a = c.post("/signout", neturl.Values{"csrf": {""}})
	require.Equal(t, http.StatusForbidden, a.status)
	require.Equal(t, 1, e.srv.Sessions())

	e.srv.mu.Lock()
	planned := len(e.srv.plans)
	e.srv.mu.Unlock()
	require.Zero(t, planned, "no refused request planned anything")
	// With the token it goes through.
	a = c.post("/plan", plan)
	require.Equal(t, http.StatusSeeOther, a.status, a.body)
	require.NotEmpty(t, ticketOf(t, a))
	require.Contains(t, e.log.String(), string(CodeCSRF))
}

func TestBadSignInsAreRateLimited(t *testing.T) {
	e := newEnv(t, Config{}) // the defaults: 5 failures within a minute
	c := e.client()
	for i := range DefaultSignInFailures {
		a := c.signIn("no_such_login_"+strconv.Itoa(i), "whatever")
		require.Equal(t, http.StatusUnauthorized, a.status)
		require.Contains(t, a.body, string(CodeSignInFailed))
	}
	// The address is blocked now: a right password is refused too.
	a := c.signIn(e.operator, operatorPassword)
	require.Equal(t, http.StatusTooManyRequests, a.status)
	require.Contains(t, a.body, string(CodeSignInRateLimited))
	n, err := strconv.Atoi(a.header.Get("Retry-After"))
	require.NoError(t, err)
	require.Positive(t, n)
	require.Equal(t, 0, e.srv.Sessions())
	require.Contains(t, e.log.String(), string(CodeSignInRateLimited))

	e.clock.Add(DefaultSignInWindow)
	c.mustSignIn(e.operator, operatorPassword)
	require.Equal(t, 1, e.srv.Sessions())
}

func TestBadSignInsForOneLoginAreRateLimitedFromAnyAddress(t *testing.T) {
	e := newEnv(t, Config{SignInFailures: 2})
	lim := e.srv.limiter
	now := e.clock.Now()
	lim.fail("login:"+e.operator, now)
	lim.fail("login:"+e.operator, now)
	a := e.client().signIn(e.operator, operatorPassword)
	require.Equal(t, http.StatusTooManyRequests, a.status)
	// Another login from the same address is not blocked.
	e.client().mustSignIn(e.approver, approverPassword)
}

func TestExpiredSessionsAreRefusedAndTheirPoolsClosed(t *testing.T) {
	e := newEnv(t, Config{IdleTimeout: DefaultIdleTimeout, MaxSession: DefaultMaxSession})
	e.park(2, "FAILED", "orders", "BROKER_DOWN")

	// Idle too long.
	c := e.client()
	c.mustSignIn(e.operator, operatorPassword)
	e.clock.Add(DefaultIdleTimeout)
	a := c.post("/plan", neturl.Values{"op": {"redrive"}})
	require.Equal(t, http.StatusUnauthorized, a.status)
	require.Contains(t, a.body, string(CodeSessionRequired))
	require.Equal(t, 0, e.srv.Sessions())
	require.Equal(t, http.StatusSeeOther, c.get("/").status)

	// Used all along, but past the absolute lifetime.
	c = e.client()
	c.mustSignIn(e.operator, operatorPassword)
	for elapsed := DefaultIdleTimeout / 2; elapsed < DefaultMaxSession; elapsed += DefaultIdleTimeout / 2 {
		e.clock.Add(DefaultIdleTimeout / 2)
		require.Equal(t, http.StatusOK, c.get("/ops").status, "at %s", elapsed)
	}
	e.clock.Add(DefaultIdleTimeout / 2)
	require.Equal(t, http.StatusSeeOther, c.get("/ops").status)
	require.Equal(t, 0, e.srv.Sessions())

	// The sweep closes sessions nobody comes back to.
	c = e.client()
	c.mustSignIn(e.approver, approverPassword)
	e.srv.mu.Lock()
	var pool *sql.DB
	for _, se := range e.srv.sessions {
		pool = se.db
	}
	e.srv.mu.Unlock()
	require.NoError(t, pool.Ping())
	e.clock.Add(DefaultIdleTimeout)
	e.srv.expire()
	require.Equal(t, 0, e.srv.Sessions())
	require.ErrorContains(t, pool.Ping(), "database is closed", "the expired session's pool is closed")
}

func TestNoSecretInAnyResponseOrLog(t *testing.T) {
	e := newEnv(t, Config{SignInFailures: 2})
	e.park(60, "FAILED", "orders", "BROKER_DOWN")
	op, ap := e.client(), e.client()
	op.mustSignIn(e.operator, operatorPassword)
	ap.mustSignIn(e.approver, approverPassword)
	// A failed sign-in with a password, and the rate limit.
	bad := e.client()
	bad.signIn("no_such_login", operatorPassword+"x")
	bad.signIn("no_such_login", approverPassword+"x")
	bad.signIn(e.operator, operatorPassword)
	// Every page, an action refused and the whole journal flow.
	for _, p := range []string{"/", "/parked", "/parked?code=BROKER_DOWN", "/row?id=orders-BROKER_DOWN-1", "/relays", "/ops", "/row?id=missing", "/parked?since=bad"} {
		op.get(p)
		ap.get(p)
	}
	ticket := ticketOf(t, op.post("/plan", neturl.Values{"op": {"redrive"}, "code": {"BROKER_DOWN"}}))
	op.get("/ops/ticket?t=" + ticket)
	op.post("/approve", neturl.Values{"ticket": {ticket}})
	ap.get("/ops/ticket?t=" + ticket)
	e.srv.mu.Lock()
	digest := e.srv.plans[ticket].Digest
	e.srv.mu.Unlock()
	ap.post("/approve", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	op.post("/execute", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	e.wait(ticket)
	op.get("/ops/ticket?t=" + ticket)
	op.post("/execute", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	op.post("/signout", nil)

	seen := e.bodies.String() + e.log.String()
	require.Contains(t, seen, e.operator, "the check reads what was served and logged")
	require.Contains(t, seen, string(CodeSignInFailed))
	for _, secret := range []string{operatorPassword, approverPassword, basePassword} {
		require.NotContains(t, seen, secret)
	}
}

func TestReadOnlyConsoleRefusesEveryAction(t *testing.T) {
	s := testdb.New(t)
	_, readerURL := s.Role(t, readerGrants...)
	reader, err := testdb.OpenURL(readerURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = reader.Close() })
	e := newEnvOn(t, s, Config{ReadOnlyDB: reader})
	e.park(5, "EXHAUSTED", "orders", "TOO_MANY")
	c := e.client()
	for _, p := range []string{"/", "/parked", "/row?id=orders-TOO_MANY-1", "/relays", "/ops"} {
		a := c.get(p)
		require.Equal(t, http.StatusOK, a.status, p)
		require.Contains(t, a.body, "read-only", p)
		require.NotContains(t, a.body, `action="/plan"`, p)
	}
	require.Contains(t, c.get("/ops").body, "holds no SELECT", "the reader's grants do not cover the journal, and the page says so")
	require.Equal(t, http.StatusSeeOther, c.get("/signin").status)
	for _, p := range []string{"/signin", "/plan", "/approve", "/execute", "/signout"} {
		a := c.post(p, neturl.Values{"op": {"purge"}, "login": {"postgres"}, "ticket": {"t"}})
		require.Equal(t, http.StatusForbidden, a.status, p)
		require.Contains(t, a.body, string(CodeReadOnly), p)
	}
	require.Equal(t, 5, s.Count(t, "status = 'EXHAUSTED'"))
}

var numberRE = regexp.MustCompile(`id="(n-[a-z]+)">([^<]*)<`)

func TestOverviewNumbersAreTheTablesCounts(t *testing.T) {
	e := newEnv(t, Config{})
	e.park(7, "FAILED", "orders", "BROKER_DOWN")
	e.park(3, "EXHAUSTED", "billing", "TOO_MANY")
	_, err := e.s.DB.Exec(`
INSERT INTO messaging_outbox (message_id, destination, payload, status, tenant, published_at)
SELECT 'p-' || g, 'orders', 'x', CASE WHEN g % 4 = 0 THEN 'PUBLISHED' WHEN g % 4 = 1 THEN 'AMBIGUOUS' ELSE 'PENDING' END,
       't' || (g % 2), CASE WHEN g % 4 = 0 THEN now() END
  FROM generate_series(1, 40) g`)
	require.NoError(t, err)
	c := e.client()
	c.mustSignIn(e.operator, operatorPassword)
	a := c.get("/")
	got := map[string]string{}
	for _, m := range numberRE.FindAllStringSubmatch(a.body, -1) {
		got[m[1]] = m[2]
	}
	for id, where := range map[string]string{
		"n-unpublished": "status <> 'PUBLISHED'",
		"n-pending":     "status IN ('PENDING', 'IN_FLIGHT', 'AMBIGUOUS')",
		"n-failed":      "status = 'FAILED'",
		"n-exhausted":   "status = 'EXHAUSTED'",
		"n-ambiguous":   "status = 'AMBIGUOUS'",
	} {
		require.Equal(t, strconv.Itoa(e.s.Count(t, where)), got[id], id)
	}
	require.Contains(t, a.body, "Delivered per minute: 10 in the last hour")
	require.Contains(t, a.body, "Parked per minute (still parked): 10 in the last hour")
	require.Regexp(t, `<td>BROKER_DOWN</td>|BROKER_DOWN</a></td><td class="r">7</td>`, a.body)
}

func TestParkedRowsPageAcrossPagesWithTheFullCount(t *testing.T) {
	e := newEnv(t, Config{PageSize: 50})
	e.park(120, "FAILED", "orders", "BROKER_DOWN")
	e.park(30, "FAILED", "orders", "SCHEMA_REJECTED")
	e.park(10, "EXHAUSTED", "billing", "BROKER_DOWN")
	c := e.client()
	c.mustSignIn(e.operator, operatorPassword)

	seen := map[string]bool{}
	path := "/parked?code=BROKER_DOWN&status=FAILED"
	pages := 0
	for path != "" {
		a := c.get(path)
		require.Equal(t, http.StatusOK, a.status, a.body)
		require.Contains(t, a.body, `<b id="matching">120</b>`, "every page counts everything the filter matches")
		ids := regexp.MustCompile(`class="row-link">([^<]+)<`).FindAllStringSubmatch(a.body, -1)
		for _, m := range ids {
			require.True(t, strings.HasPrefix(m[1], "orders-BROKER_DOWN-"), m[1])
			require.False(t, seen[m[1]], "row %s on two pages", m[1])
			seen[m[1]] = true
		}
		pages++
		path = ""
		if m := regexp.MustCompile(`href="([^"]+)" id="next-page"`).FindStringSubmatch(a.body); m != nil {
			path = strings.ReplaceAll(m[1], "&amp;", "&")
		}
	}
	require.Equal(t, 3, pages)
	require.Len(t, seen, 120)

	for q, want := range map[string]string{"": "160", "?destination=billing": "10", "?status=EXHAUSTED&code=BROKER_DOWN": "10", "?tenant=t1": "54"} {
		a := c.get("/parked" + q)
		require.Contains(t, a.body, `<b id="matching">`+want+`</b>`, q)
	}
	for _, q := range []string{"?status=PENDING", "?since=yesterday", "?after=-4", "?since=2030-01-02T00:00:00Z&until=2029-01-01T00:00:00Z"} {
		a := c.get("/parked" + q)
		require.Equal(t, http.StatusBadRequest, a.status, q)
	}
}

func TestInspectorShowsApplicationTextAsText(t *testing.T) {
	e := newEnv(t, Config{})
	hostile := "\x1b[2J\x1b]0;owned\x07<script>alert(1)</script>"
	_, err := e.s.DB.Exec(`
INSERT INTO messaging_outbox (message_id, destination, payload, headers, status, parked_at, last_failure_code, last_failure_detail)
VALUES ('evil-1', $1, convert_to($1, 'UTF8'), jsonb_build_object('x-evil', $1::text, $1::text, 'v'), 'FAILED', now(), 'BAD', $1)`, hostile)
	require.NoError(t, err)
	c := e.client()
	c.mustSignIn(e.operator, operatorPassword)
	for _, p := range []string{"/row?id=evil-1", "/parked", "/"} {
		a := c.get(p)
		require.Equal(t, http.StatusOK, a.status)
		require.NotContains(t, a.body, "<script>", p)
		require.NotContains(t, a.body, "\x1b", p)
		require.NotContains(t, a.body, "\x07", p)
		require.Contains(t, a.body, `\x1b[2J\x1b]0;owned\a&lt;script&gt;alert(1)&lt;/script&gt;`, p)
	}
	a := c.get("/row?id=evil-1")
	require.Contains(t, a.body, `id="payload-size">`+strconv.Itoa(len(hostile))+` bytes, text`)
	require.Contains(t, a.body, "x-evil")
	require.Equal(t, http.StatusNotFound, c.get("/row?id=nope").status)
}

func TestPlanApproveExecuteThroughTheJournal(t *testing.T) {
	e := newEnv(t, Config{})
	e.park(25, "FAILED", "orders", "BROKER_DOWN")
	e.park(5, "FAILED", "orders", "OTHER")
	op, ap := e.client(), e.client()
	op.mustSignIn(e.operator, operatorPassword)
	ap.mustSignIn(e.approver, approverPassword)

	ticket := ticketOf(t, op.post("/plan", neturl.Values{"op": {"redrive"}, "code": {"BROKER_DOWN"}}))
	page := op.get("/ops/ticket?t=" + ticket)
	require.Contains(t, page.body, `id="plan-matching">25<`)
	digest := regexp.MustCompile(`id="plan-digest">([0-9a-f]+)<`).FindStringSubmatch(page.body)[1]

	// Not approved: execution refused by the journal.
	a := op.post("/execute", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.Equal(t, http.StatusForbidden, a.status)
	require.Contains(t, a.body, "JOURNAL_NOT_APPROVED")
	// The planner cannot approve their own plan.
	a = op.post("/approve", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.Equal(t, http.StatusForbidden, a.status)
	require.Contains(t, a.body, string(CodeSelfApproval))
	// A stale page's digest is refused.
	a = ap.post("/approve", neturl.Values{"ticket": {ticket}, "digest": {"0000"}})
	require.Equal(t, http.StatusConflict, a.status)

	a = ap.post("/approve", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.Equal(t, http.StatusSeeOther, a.status, a.body)
	var by string
	var count int
	require.NoError(t, e.s.DB.QueryRow(`SELECT approved_by, approved_count FROM messaging_admin_approval WHERE approval_ticket = $1`, ticket).Scan(&by, &count))
	require.Equal(t, e.approver, by, "the database records the approving login")
	require.Equal(t, 25, count)
	a = ap.post("/approve", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.Equal(t, http.StatusConflict, a.status)
	require.Contains(t, a.body, "JOURNAL_ALREADY_APPROVED")
	// The approver holds no grant to execute.
	a = ap.post("/execute", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.NotEqual(t, http.StatusSeeOther, a.status)
	require.Equal(t, 25, e.s.Count(t, "status = 'FAILED' AND last_failure_code = 'BROKER_DOWN'"))

	a = op.post("/execute", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.Equal(t, http.StatusSeeOther, a.status, a.body)
	e.wait(ticket)
	require.Equal(t, 25, e.s.Count(t, "status = 'PENDING' AND attempts = 0"))
	require.Equal(t, 5, e.s.Count(t, "status = 'FAILED'"), "rows outside the plan are left alone")
	page = op.get("/ops/ticket?t=" + ticket)
	require.Contains(t, page.body, `id="state">COMPLETED<`)
	require.Contains(t, page.body, `id="items">25<`)
	ops := op.get("/ops")
	require.Contains(t, ops.body, ticket)
	require.Contains(t, ops.body, e.operator)
	require.NotContains(t, ops.body[:strings.Index(ops.body, "<h2>Approvals</h2>")], ticket, "an approved plan waits no more")

	// Executed once: a second execution is refused, as in the CLI.
	a = op.post("/execute", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.Equal(t, http.StatusConflict, a.status)
	require.Contains(t, a.body, "JOURNAL_ALREADY_EXECUTED")

	// A login without INSERT on the approvals cannot approve someone
	// else's plan either: the database refuses it.
	t2 := ticketOf(t, ap.post("/plan", neturl.Values{"op": {"purge"}, "code": {"OTHER"}}))
	d2 := regexp.MustCompile(`id="plan-digest">([0-9a-f]+)<`).FindStringSubmatch(ap.get("/ops/ticket?t=" + t2).body)[1]
	a = op.post("/approve", neturl.Values{"ticket": {t2}, "digest": {d2}})
	require.Equal(t, http.StatusForbidden, a.status)
	require.Contains(t, a.body, "permission denied")
	require.Equal(t, 5, e.s.Count(t, "status = 'FAILED' AND last_failure_code = 'OTHER'"))
	require.Equal(t, http.StatusNotFound, op.post("/approve", neturl.Values{"ticket": {"console-20300102-00000000"}}).status)
}

func TestPageQueriesUseIndexes(t *testing.T) {
	s := testdb.New(t)
	ctx := context.Background()
	_, err := s.DB.ExecContext(ctx, `
INSERT INTO messaging_outbox (message_id, destination, payload, status, tenant, created_at, published_at, parked_at, last_failure_code)
SELECT 'r-' || g, 'dest-' || (g % 50), 'x',
       CASE WHEN g % 100 = 0 THEN 'FAILED' WHEN g % 100 = 1 THEN 'EXHAUSTED' WHEN g % 10 = 2 THEN 'PENDING' ELSE 'PUBLISHED' END,
       't' || (g % 20), now() - make_interval(secs => g),
       CASE WHEN g % 10 <> 2 AND g % 100 NOT IN (0, 1) THEN now() - make_interval(secs => g / 10) END,
       CASE WHEN g % 100 IN (0, 1) THEN now() - make_interval(secs => g) END,
       CASE WHEN g % 100 IN (0, 1) THEN 'CODE_' || (g % 7) END
  FROM generate_series(1, 60000) g`)
	require.NoError(t, err)
	_, err = s.DB.ExecContext(ctx, `VACUUM ANALYZE messaging_outbox`)
	require.NoError(t, err)
	for _, q := range []struct {
		name  string
		query string
		args  []any
	}{
		{"deliveredPerMinuteQuery", deliveredPerMinuteQuery, []any{"2030-01-01T00:00:00Z"}},
		{"parkedPerMinuteQuery", parkedPerMinuteQuery, []any{"2030-01-01T00:00:00Z"}},
		{"parkedPageQuery", parkedPageQuery, []any{"{FAILED,EXHAUSTED}", nil, nil, nil, nil, nil, 0, 50}},
		{"parkedPageQuery filtered", parkedPageQuery, []any{"{FAILED}", "dest-3", "t4", "CODE_1", "2020-01-01T00:00:00Z", "2040-01-01T00:00:00Z", 100, 50}},
		{"heldOffQuery", heldOffQuery, []any{"{dest-1,dest-2}", heldOffLimit}},
		{"oldestUndeliveredQuery", oldestUndeliveredQuery, nil},
	} {
		for _, generic := range []bool{false, true} {
			plan := explain(t, s, q.query, generic, q.args...)
			require.NotContains(t, plan, "Seq Scan on messaging_outbox", "%s (generic plan %v):\n%s", q.name, generic, plan)
			require.Contains(t, plan, "messaging_outbox_", "%s reads an index:\n%s", q.name, plan)
		}
	}
}

// explain returns the text EXPLAIN of q with args, run as a prepared
// statement on a custom or on its generic plan (a pooled prepared statement
// gets the generic one after five executions).
func explain(t *testing.T, s *testdb.Schema, q string, generic bool, args ...any) string {
	t.Helper()
	ctx := context.Background()
	conn, err := s.DB.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	_, err = conn.ExecContext(ctx, "SET plan_cache_mode = "+mode)
	require.NoError(t, err)
	defer func() { _, _ = conn.ExecContext(ctx, "RESET plan_cache_mode") }()
	return testdb.ExplainPrepared(t, conn, "", q, args...)
}

// flip returns token with its first character changed.
func flip(token string) string {
	if token[0] == 'A' {
		return "B" + token[1:]
	}
	return "A" + token[1:]
}

func TestOverviewFiguresAreRefreshedInTheBackgroundOnceStale(t *testing.T) {
	e := newEnv(t, Config{OverviewMaxAge: 10 * time.Second})
	e.park(3, "FAILED", "orders", "BROKER_DOWN")
	c := e.client()
	c.mustSignIn(e.operator, operatorPassword) // its first overview read the figures
	failed := func() string { return numberRE.FindAllStringSubmatch(c.get("/").body, -1)[3][2] }
	require.Equal(t, "3", failed())

	e.park(4, "FAILED", "billing", "BROKER_DOWN")
	require.Equal(t, "3", failed(), "younger than the maximum age: answered from the figures read")
	require.Equal(t, "7", numberRE.FindAllStringSubmatch(c.get("/?fresh=1").body, -1)[3][2], "?fresh=1 reads them now")

	e.park(5, "FAILED", "billing", "OTHER")
	e.clock.Add(10 * time.Second)
	require.Equal(t, "7", failed(), "stale: answered at once from the figures it has, with a refresh started")
	var se *session
	e.srv.mu.Lock()
	for _, x := range e.srv.sessions {
		se = x
	}
	e.srv.mu.Unlock()
	se.ov.mu.Lock()
	refresh := se.ov.last
	se.ov.mu.Unlock()
	require.NotNil(t, refresh, "a refresh was started")
	<-refresh
	require.Equal(t, "12", failed(), "the refreshed figures")
	require.Contains(t, c.get("/").body, "0s ago")
}

// The relays page shows which lanes each live relay holds, and tells a login
// without SELECT on messaging_relay_lane that it cannot see them.
func TestRelaysPageShowsTheLanesEachRelayHolds(t *testing.T) {
	e := newEnv(t, Config{})
	ctx := context.Background()
	require.NoError(t, relaymode.BeatBudget(ctx, e.s.DB, "lane-relay-a", time.Minute, 5))
	st, err := fencing.TakeLanes(ctx, e.s.DB, fencing.LaneParams{Owner: "lane-relay-a", TTL: time.Minute, MaxAttempts: 5})
	require.NoError(t, err)
	require.NotEmpty(t, st.Owned)

	// A login without SELECT on the lanes is told so; the rest of the
	// page is served.
	nolanes, _ := e.s.Role(t, readerGrantsWithoutLanes...)
	_, err = e.s.DB.Exec("ALTER ROLE " + nolanes + " PASSWORD 'x'")
	require.NoError(t, err)
	c := e.client()
	require.Equal(t, http.StatusSeeOther, c.signIn(nolanes, "x").status)
	a := c.get("/relays")
	require.Equal(t, http.StatusOK, a.status)
	require.Contains(t, a.body, "lane-relay-a")
	require.Contains(t, a.body, "holds no SELECT on messaging_relay_lane")

	c = e.client()
	c.mustSignIn(e.operator, operatorPassword)
	a = c.get("/relays")
	require.Contains(t, a.body, `id="lane-owners"`)
	require.Regexp(t, `<td>lane-relay-a</td><td class="r">`+strconv.Itoa(len(st.Owned))+`</td>`, a.body)
	require.Contains(t, a.body, strconv.Itoa(st.Total)+" lanes, "+strconv.Itoa(st.Total-len(st.Owned))+" without a live owner")
}

// An execution that runs longer than a request goes on in the background;
// its ticket page shows it running, with its progress, and reloads itself
// until it ends.
func TestTicketPageShowsARunningExecutionsProgress(t *testing.T) {
	e := newEnv(t, Config{})
	e.park(1200, "FAILED", "orders", "BROKER_DOWN") // three batches of 500
	op, ap := e.client(), e.client()
	op.mustSignIn(e.operator, operatorPassword)
	ap.mustSignIn(e.approver, approverPassword)
	ticket := ticketOf(t, op.post("/plan", neturl.Values{"op": {"redrive"}}))
	e.srv.mu.Lock()
	digest := e.srv.plans[ticket].Digest
	e.srv.mu.Unlock()
	require.Equal(t, http.StatusSeeOther, ap.post("/approve", neturl.Values{"ticket": {ticket}, "digest": {digest}}).status)

	// Another session holds the last row: the third batch waits for it.
	ctx := context.Background()
	lock, err := e.s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback() }()
	_, err = lock.ExecContext(ctx, `SELECT 1 FROM messaging_outbox WHERE message_id = 'orders-BROKER_DOWN-1200' FOR UPDATE`)
	require.NoError(t, err)

	a := op.post("/execute", neturl.Values{"ticket": {ticket}, "digest": {digest}})
	require.Equal(t, http.StatusSeeOther, a.status, "answered once the first batch is committed")
	page := op.get("/ops/ticket?t=" + ticket)
	require.Contains(t, page.body, `<meta http-equiv="refresh" content="2">`)
	require.Regexp(t, `id="running">Running: (500|1000) of 1200 rows`, page.body)
	require.Regexp(t, `id="state">STARTED<`, page.body)
	require.NotContains(t, page.body, `id="execute"`, "no second start while it runs")

	require.NoError(t, lock.Rollback())
	e.wait(ticket)
	page = op.get("/ops/ticket?t=" + ticket)
	require.NotContains(t, page.body, `http-equiv="refresh"`)
	require.Contains(t, page.body, `id="items">1200<`)
	require.Equal(t, 1200, e.s.Count(t, "status = 'PENDING'"))
}

// The relays page lists each open breaker of a live relay with the rows it
// holds off, and the live relays with their budgets; readiness follows the
// relay mode's kind of relay.
func TestRelaysPageShowsBreakersAndReadiness(t *testing.T) {
	e := newEnv(t, Config{})
	c := e.client()
	c.mustSignIn(e.operator, operatorPassword)
	a := c.get("/relays")
	require.Contains(t, a.body, `id="readiness" class="warn">Not ready`)

	ctx := context.Background()
	require.NoError(t, relaymode.BeatBudget(ctx, e.s.DB, "relay-b", time.Minute, 7))
	_, err := e.s.DB.Exec(`INSERT INTO messaging_relay_breaker (owner, destination, last_error) VALUES ('relay-b', 'payments', $1)`, "broker down \x1b[31m<b>")
	require.NoError(t, err)
	_, err = e.s.DB.Exec(`
INSERT INTO messaging_outbox (message_id, destination, payload)
SELECT 'w-' || g, CASE WHEN g <= 12 THEN 'payments' ELSE 'orders' END, 'x' FROM generate_series(1, 20) g`)
	require.NoError(t, err)
	a = c.get("/relays")
	require.Equal(t, http.StatusOK, a.status)
	require.Contains(t, a.body, `id="readiness" class="ok">Ready`)
	require.Regexp(t, `<td>relay-b</td>.*<td>7</td>`, a.body)
	require.Contains(t, a.body, `<td>payments</td><td>relay-b</td>`)
	require.Contains(t, a.body, `<td class="r">12</td><td><code>broker down \x1b[31m&lt;b&gt;</code></td>`)
}
