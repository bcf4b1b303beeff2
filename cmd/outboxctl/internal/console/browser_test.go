package console

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// ChromiumEnv names the browser binary the browser test drives (default
// /usr/bin/chromium, Debian's package; scripts/ensure-chromium.sh installs
// it where the project's scripts run as root).
const ChromiumEnv = "OUTBOX_CHROMIUM"

// ScreenshotsEnv, set to 1, makes the browser test save a screenshot of
// each page into docs/console/ (off by default, so a test run does not
// change the tree).
const ScreenshotsEnv = "OUTBOX_CONSOLE_SCREENSHOTS"

func chromium(t *testing.T) string {
	path := os.Getenv(ChromiumEnv)
	if path == "" {
		path = "/usr/bin/chromium"
	}
	if _, err := os.Stat(path); err != nil {
		t.Skipf("chromium is not installed at %s (run scripts/ensure-chromium.sh as root, or set %s): the browser test needs Debian's chromium", path, ChromiumEnv)
	}
	return path
}

// browser starts a headless Chromium with a fresh profile and returns a
// context whose actions drive one tab.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromium(t)),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 1000),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(actx)
	t.Cleanup(func() {
		cancelTab()
		cancelAlloc()
	})
	// A bound for the whole scenario, so a hung browser fails the test
	// instead of the suite's timeout.
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	t.Cleanup(cancel)
	require.NoError(t, chromedp.Do(ctx), "start chromium")
	return ctx
}

type page struct {
	t   *testing.T
	ctx context.Context
	e   *env
}

func (p *page) run(actions ...chromedp.Action[chromedp.Void]) {
	p.t.Helper()
	require.NoError(p.t, chromedp.Do(p.ctx, actions...))
}

// eval returns the value of a JavaScript expression in the page.
func eval[T any](p *page, expr string) T {
	p.t.Helper()
	v, err := chromedp.Run(p.ctx, chromedp.Evaluate[T](expr))
	require.NoError(p.t, err, expr)
	return v
}

func (p *page) text(sel string) string {
	p.t.Helper()
	s, err := chromedp.Run(p.ctx, chromedp.Text(chromedp.CSS(sel)))
	require.NoError(p.t, err, sel)
	return strings.TrimSpace(s)
}

func (p *page) open(path string) {
	p.t.Helper()
	p.run(chromedp.Navigate(p.e.ts.URL+path), chromedp.WaitReady(chromedp.CSS("body")))
}

func (p *page) signIn(login, password string) {
	p.t.Helper()
	p.open("/signin")
	p.run(
		chromedp.SendKeys(chromedp.CSS("#f-login"), login),
		chromedp.SendKeys(chromedp.CSS("#f-password"), password),
	)
	p.click("#signin", "#login")
	require.Equal(p.t, login, p.text("#login"))
}

func (p *page) signOut() {
	p.t.Helper()
	p.click("#signout", "#f-login")
}

// click clicks sel, which loads another page, waits for that page and
// then for waitFor on it.
func (p *page) click(sel, waitFor string) {
	p.t.Helper()
	_, err := chromedp.RunResponse(p.ctx, chromedp.Click(chromedp.CSS(sel)))
	require.NoError(p.t, err, "click %s", sel)
	p.run(chromedp.WaitVisible(chromedp.CSS(waitFor)))
}

func (p *page) screenshot(name string) {
	p.t.Helper()
	if os.Getenv(ScreenshotsEnv) != "1" {
		return
	}
	png, err := chromedp.Run(p.ctx, chromedp.FullScreenshot(100))
	require.NoError(p.t, err)
	dir := filepath.Join("..", "..", "..", "..", "docs", "console")
	require.NoError(p.t, os.MkdirAll(dir, 0o755))
	require.NoError(p.t, os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644))
}

// TestConsoleInABrowser drives the console in headless Chromium through
// the acceptance scenario of issue 31, with a relay running beside it.
func TestConsoleInABrowser(t *testing.T) {
	chromium(t)
	e := newEnv(t, Config{PageSize: 50})
	ctx := browser(t)
	p := &page{t: t, ctx: ctx, e: e}

	// The table: 120 rows parked on BROKER_DOWN (three pages), 30 on
	// another code, a hostile row, and an hour of deliveries.
	e.park(120, "FAILED", "orders", "BROKER_DOWN")
	e.park(30, "EXHAUSTED", "billing", "SCHEMA_REJECTED")
	hostile := "\x1b[31m\x1b]0;pwned\x07<script>document.title='pwned'</script><img src=x>"
	_, err := e.s.DB.Exec(`
INSERT INTO messaging_outbox (message_id, destination, payload, headers, status, parked_at, last_failure_code, last_failure_detail)
VALUES ('hostile-1', $1, convert_to($1, 'UTF8'), jsonb_build_object('x-note', $1::text), 'FAILED', now(), 'HOSTILE', $1)`, hostile)
	require.NoError(t, err)
	_, err = e.s.DB.Exec(`
INSERT INTO messaging_outbox (message_id, destination, payload, status, tenant, created_at, published_at)
SELECT 'done-' || g, 'dest-' || (g % 5), 'x', 'PUBLISHED', 't' || (g % 3), now() - make_interval(secs => g * 9), now() - make_interval(secs => g * 9)
  FROM generate_series(1, 400) g`)
	require.NoError(t, err)

	// A relay delivering to an in-process broker, and a subscriber that
	// counts what it receives on the redriven rows' topic.
	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1000}, watermill.NopLogger{})
	t.Cleanup(func() { _ = broker.Close() })
	received, err := broker.Subscribe(context.Background(), "orders")
	require.NoError(t, err)
	// The relay reports each pass once its outcomes are written: the test
	// waits on the reports that add up to the redriven rows.
	var published atomic.Int64
	allPublished := make(chan struct{})
	var once sync.Once
	relay, err := forwarder.New(e.s.Open(t), broker, nil, forwarder.Config{
		Owner: "browser-test-relay", PollInterval: 100 * time.Millisecond,
		OnReport: func(r forwarder.Report) {
			if published.Add(int64(r.Published)) >= 120 {
				once.Do(func() { close(allPublished) })
			}
		},
	})
	require.NoError(t, err)
	relayCtx, stopRelay := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	t.Cleanup(func() {
		stopRelay()
		<-relayDone
		_ = relay.Close()
	})
	select {
	case <-relay.Running():
	case <-time.After(time.Minute):
		t.Fatal("the relay did not start")
	}

	// Sign in as the operator; the overview's numbers are the table's.
	p.signIn(e.operator, operatorPassword)
	p.open("/")
	for id, where := range map[string]string{
		"#n-unpublished": "status <> 'PUBLISHED'",
		"#n-failed":      "status = 'FAILED'",
		"#n-exhausted":   "status = 'EXHAUSTED'",
		"#n-pending":     "status IN ('PENDING', 'IN_FLIGHT', 'AMBIGUOUS')",
	} {
		require.Equal(t, strconv.Itoa(e.s.Count(t, where)), p.text(id), id)
	}
	require.Contains(t, p.text("figure.chart figcaption"), "Delivered per minute: ")
	require.Equal(t, 2*chartMinutes, eval[int](p, `document.querySelectorAll('figure.chart svg rect.bar').length`), "two charts of one bar a minute")
	p.screenshot("overview")

	// Parked rows, filtered to one failure code, across pages.
	p.open("/parked")
	p.run(chromedp.SendKeys(chromedp.CSS("#q-code"), "BROKER_DOWN"))
	p.click("#apply", "#parked-rows")
	require.Equal(t, "120", p.text("#matching"))
	p.screenshot("parked")
	seen := map[string]bool{}
	for pageNo := 1; ; pageNo++ {
		ids := eval[[]string](p, `Array.from(document.querySelectorAll('a.row-link')).map(a => a.textContent)`)
		for _, id := range ids {
			require.True(t, strings.HasPrefix(id, "orders-BROKER_DOWN-"), id)
			require.False(t, seen[id], "%s on two pages", id)
			seen[id] = true
		}
		if !eval[bool](p, `document.querySelector('#next-page') !== null`) {
			require.Equal(t, 3, pageNo)
			break
		}
		p.click("#next-page", "#parked-rows")
	}
	require.Len(t, seen, 120)

	// The hostile row: escape sequences and markup shown as text, nothing
	// run, nothing injected.
	p.open("/row?id=hostile-1")
	shown := `\x1b[31m\x1b]0;pwned\a<script>document.title='pwned'</script><img src=x>`
	require.Equal(t, shown, p.text("#payload"))
	require.NotEqual(t, "pwned", eval[string](p, `document.title`))
	require.Zero(t, eval[int](p, `document.querySelectorAll('script').length`))
	require.Zero(t, eval[int](p, `document.querySelectorAll('img').length`))
	cells := eval[[]string](p, `Array.from(document.querySelectorAll('#columns td, #headers td')).map(td => td.textContent)`)
	require.Contains(t, cells, shown, "the topic and the failure detail")
	require.Equal(t, shown, p.text("#headers td"), "the header")
	p.screenshot("row")

	// Plan a redrive of everything the filter matches (three pages).
	p.open("/parked?code=BROKER_DOWN")
	p.click("#plan-redrive", "#ticket")
	ticket := p.text("#ticket")
	require.Equal(t, "120", p.text("#plan-matching"))
	p.screenshot("ticket-planned")
	// The operator cannot approve their own plan.
	p.click("#approve", "#error")
	require.Contains(t, p.text("#error"), string(CodeSelfApproval))
	p.signOut()

	// The approver approves it.
	p.signIn(e.approver, approverPassword)
	p.open("/ops/ticket?t=" + ticket)
	p.click("#approve", "#approved-by")
	require.Equal(t, e.approver, p.text("#approved-by"))
	require.Equal(t, "120", p.text("#approved-count"))
	p.signOut()

	// Back as the operator: execute; the relay delivers the rows.
	p.signIn(e.operator, operatorPassword)
	p.open("/ops/ticket?t=" + ticket)
	p.click("#execute", "#ticket")
	e.wait(ticket)
	p.open("/ops/ticket?t=" + ticket)
	require.Equal(t, "COMPLETED", p.text("#state"))
	require.Equal(t, "120", p.text("#items"))
	p.screenshot("ticket-executed")
	for n := 0; n < 120; n++ {
		select {
		case msg := <-received:
			msg.Ack()
		case <-time.After(time.Minute):
			t.Fatalf("the relay delivered %d of the 120 redriven rows", n)
		}
	}
	select {
	case <-allPublished:
	case <-time.After(time.Minute):
		t.Fatalf("the relay recorded %d of the 120 redriven rows as published", published.Load())
	}
	require.Equal(t, 120, e.s.Count(t, "status = 'PUBLISHED' AND destination = 'orders'"))

	// The ticket cannot be executed again.
	p.click("#execute", "#error")
	require.Contains(t, p.text("#error"), "JOURNAL_ALREADY_EXECUTED")

	// The relays and the journal as the operator sees them.
	p.open("/relays")
	require.Contains(t, p.text("#relays"), "browser-test-relay")
	require.Contains(t, p.text("#readiness"), "Ready")
	p.screenshot("relays")
	p.open("/ops")
	require.Contains(t, p.text("#operations"), ticket)
	require.Contains(t, p.text("#approvals"), e.approver)
	p.screenshot("ops")
	p.open("/?fresh=1")
	require.Equal(t, strconv.Itoa(e.s.Count(t, "status = 'FAILED'")), p.text("#n-failed"))
	p.screenshot("overview-after")
}
