package console

import (
	"context"
	"fmt"
	"net/http"
	neturl "net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// discard is a downstream that accepts every message (the relay's work is
// the database's part: claims and outcome writes).
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

// The benchmark's table: 1,000,000 rows over 50 destinations and 20
// tenants: 10,000 parked (FAILED and EXHAUSTED, 8 failure codes), 150,000
// PENDING for the relay to drain, the rest PUBLISHED over the last 72 hours
// (a retention horizon of three days).
const (
	benchRows    = 1_000_000
	benchParked  = 10_000
	benchPending = 150_000
	benchSamples = 40 // requests per page
	benchFresh   = 10 // overview requests with ?fresh=1
)

// BenchmarkConsolePages fills a dedicated schema with benchRows rows,
// starts a relay draining the pending ones, and requests every page of the
// console benchSamples times while it drains, as a signed-in operator. It
// reports each page's p50, p95 and max in milliseconds (make
// bench-console; the result is in docs/CONSOLE.md). It asserts no time.
func BenchmarkConsolePages(b *testing.B) {
	e := newEnv(b, Config{PageSize: 50})
	ctx := context.Background()
	start := time.Now()
	_, err := e.s.DB.ExecContext(ctx, `
INSERT INTO messaging_outbox (message_id, destination, payload, status, tenant, created_at, published_at, parked_at,
                              attempts, last_failure_code, last_failure_detail, correlation_id)
SELECT 'm-' || g, 'dest-' || (g % 50), convert_to('{"order":' || g || ',"note":"benchmark row"}', 'UTF8'),
       CASE WHEN g <= $1 THEN (CASE WHEN g % 2 = 0 THEN 'FAILED' ELSE 'EXHAUSTED' END)
            WHEN g <= $1 + $2 THEN 'PENDING' ELSE 'PUBLISHED' END,
       't' || (g % 20),
       now() - make_interval(secs => (($3 - g) % 259200)),
       CASE WHEN g > $1 + $2 THEN now() - make_interval(secs => (($3 - g) % 259200)) END,
       CASE WHEN g <= $1 THEN now() - make_interval(secs => g % 7200) END,
       CASE WHEN g <= $1 THEN 5 ELSE 0 END,
       CASE WHEN g <= $1 THEN 'CODE_' || (g % 8) END,
       CASE WHEN g <= $1 THEN 'the broker said no' END,
       'corr-' || (g % 100000)
  FROM generate_series(1, $3::int) g`, benchParked, benchPending, benchRows)
	require.NoError(b, err)
	_, err = e.s.DB.ExecContext(ctx, `VACUUM ANALYZE messaging_outbox`)
	require.NoError(b, err)
	b.Logf("filled %d rows (%d parked, %d pending) in %s", benchRows, benchParked, benchPending, time.Since(start).Round(time.Second))

	c := e.client()
	c.mustSignIn(e.operator, operatorPassword)
	// A ticket to show, planned and approved (not executed: the parked
	// rows stay for the parked pages).
	ap := e.client()
	ap.mustSignIn(e.approver, approverPassword)
	ticket := ticketOf(b, c.post("/plan", neturl.Values{"op": {"redrive"}, "code": {"CODE_3"}}))
	e.srv.mu.Lock()
	digest := e.srv.plans[ticket].Digest
	e.srv.mu.Unlock()
	require.Equal(b, http.StatusSeeOther, ap.post("/approve", neturl.Values{"ticket": {ticket}, "digest": {digest}}).status)
	// The third page of one failure code (a keyset cursor deep in the index).
	third := "/parked?code=CODE_5"
	for range 2 {
		a := c.get(third)
		i := strings.Index(a.body, `" id="next-page"`)
		require.Positive(b, i)
		third = strings.ReplaceAll(a.body[strings.LastIndex(a.body[:i], `href="`)+6:i], "&amp;", "&")
	}
	pages := []struct{ name, path string }{
		{"overview", "/"},
		{"parked (all)", "/parked"},
		{"parked (one code, status, tenant)", "/parked?code=CODE_2&status=FAILED&tenant=t2"},
		{"parked (page 3 of one code)", third},
		{"row inspector", "/row?id=m-4242"},
		{"relays", "/relays"},
		{"admin operations", "/ops"},
		{"ticket", "/ops/ticket?t=" + ticket},
	}

	relay, err := forwarder.New(e.s.Open(b), discard{}, nil, forwarder.Config{Owner: "bench-relay"})
	require.NoError(b, err)
	relayCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(relayCtx) }()
	defer func() {
		stop()
		<-done
		_ = relay.Close()
	}()
	<-relay.Running()
	before := e.s.Count(b, "status = 'PUBLISHED'")

	samples := make([][]time.Duration, len(pages))
	began := time.Now()
	b.ResetTimer()
	for range b.N {
		for range benchSamples {
			for i, p := range pages {
				t0 := time.Now()
				a := c.get(p.path)
				samples[i] = append(samples[i], time.Since(t0))
				require.Equal(b, http.StatusOK, a.status, "%s: %s", p.name, a.body)
			}
		}
	}
	b.StopTimer()
	elapsed := time.Since(began)
	drained := e.s.Count(b, "status = 'PUBLISHED'") - before
	left := e.s.Count(b, "status IN ('PENDING', 'IN_FLIGHT')")
	require.Positive(b, drained, "the relay drained rows while the pages were read")
	// What the overview's figures cost to read (the background refresh,
	// or a request with ?fresh=1), measured apart: the page itself answers
	// from the figures it has.
	var fresh []time.Duration
	for range benchFresh {
		t0 := time.Now()
		a := c.get("/?fresh=1")
		fresh = append(fresh, time.Since(t0))
		require.Equal(b, http.StatusOK, a.status)
	}

	var report strings.Builder
	fmt.Fprintf(&report, "\n| page | p50 ms | p95 ms | max ms |\n|---|---:|---:|---:|\n")
	for i, p := range pages {
		s := slices.Clone(samples[i])
		slices.Sort(s)
		q := func(f float64) float64 { return float64(s[int(f*float64(len(s)-1))].Microseconds()) / 1000 }
		fmt.Fprintf(&report, "| %s | %.1f | %.1f | %.1f |\n", p.name, q(0.5), q(0.95), q(1))
		b.ReportMetric(q(0.95), "p95-ms/"+strings.Join(strings.FieldsFunc(p.name, func(r rune) bool { return r == ' ' || r == '(' || r == ')' || r == ',' }), "-"))
	}
	slices.Sort(fresh)
	fmt.Fprintf(&report, "| overview figures read now (?fresh=1, the background refresh) | %.1f | %.1f | %.1f |\n",
		float64(fresh[len(fresh)/2].Microseconds())/1000, float64(fresh[int(0.95*float64(len(fresh)-1))].Microseconds())/1000, float64(fresh[len(fresh)-1].Microseconds())/1000)
	fmt.Fprintf(&report, "\n%d requests per page in %s while the relay published %d rows (%.0f rows/s; %d still waiting at the end)\n",
		benchSamples*b.N, elapsed.Round(time.Second), drained, float64(drained)/elapsed.Seconds(), left)
	b.Log(report.String())
}
