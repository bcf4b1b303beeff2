package forwarder_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/status"
)

// maxProbes is the highest probe count any report showed for dest.
func (rs *relaySet) maxProbes(dest string) int {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	n := 0
	for _, r := range rs.reps {
		for _, b := range r.OpenBreakers {
			if b.Destination == dest && b.Probes > n {
				n = b.Probes
			}
		}
	}
	return n
}

// waitSettledOrProbed polls until done() holds, or until the relays have
// reported at least probes probes on dest (evidence that the relay keeps
// probing instead of settling). It returns done()'s final value. No timing
// threshold: the bound is a count of events.
func waitSettledOrProbed(t *testing.T, rs *relaySet, dest string, probes int, done func() bool) bool {
	t.Helper()
	for {
		if done() {
			return true
		}
		if rs.maxProbes(dest) >= probes {
			return done()
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Regression (hostile review): a broker outage that has ended, and a poison message that happens
// to be the oldest row of its destination. After the outage the breaker
// probes with the lowest-seq row: the poison one. Its failure (a different
// error than the outage's) must be counted as the poison's attempt, and the
// breaker must let the rest of the backlog flow. Guarantee: a poison message
// ends EXHAUSTED and never holds the breaker open; nothing committed is left
// undelivered once the broker is back.
func TestHostilePoisonProbeAfterOutageStallsDestination(t *testing.T) {
	t.Parallel() // its own schema and relay: overlaps the other parallel tests
	s := newDB(t)
	insertN(t, s.DB, "orders", "poison")
	fill(t, s, "orders", "good", 50)
	out := newOutage("orders") // the broker is down
	out.failWith = func(_ string, m *message.Message) (bool, error) {
		if m.UUID == "poison" {
			return false, errors.New("serializer: field 7 out of range")
		}
		return false, nil
	}
	cfg := outageConfig()
	cfg.MaxAttempts = 4
	rs := startRelays(t, s, out, 1, cfg)
	// The outage opens the breaker.
	for !rs.sawOpen("orders") {
		time.Sleep(5 * time.Millisecond)
	}
	out.set("orders", false) // the broker is back
	settled := waitSettledOrProbed(t, rs, "orders", 40, func() bool {
		st := statusCounts(t, s)
		return st["PUBLISHED"] == 50 && st["EXHAUSTED"] == 1
	})
	rs.stop(t)
	st := statusCounts(t, s)
	poison := state(t, s.DB, "poison")
	delivered, _ := out.counts()
	require.True(t, settled, "40 probes after the broker came back: statuses %v, %d of 50 good rows delivered, poison row %+v (attempts %d of 4): the poison probe keeps the breaker open and never spends its budget",
		st, delivered, poison, poison.Attempts)
}

// Regression (hostile review): two poison messages with the same error (a schema rejection that
// the default classifier cannot tell from an ambiguous failure) are the only
// rows of their destination when a pass runs. Then good rows arrive.
// Guarantee: the poison messages end EXHAUSTED (they may open the breaker
// meanwhile, but cannot hold it open: the README says so) and the good rows
// are delivered.
//
// Observed before the fix: the pass-wide rule put the pair back without an
// attempt every time the two were claimed together, a probe of a good row
// closed the breaker and its closing forgot them, and the pair tripped it
// again: 0.3 s to 59 s, settling only when a pass happened to carry one of
// them alone. The relay now remembers the messages it excused: once the
// destination has confirmed another message, the pair failing alike again
// spends attempts. So once the good rows are all delivered, each failed
// publish of a poison message spends one of its 4 attempts: the wait below
// gives up, as a failure, after 40 failed publishes of the poisons past that
// point (8 at most are needed), and otherwise only at the test's deadline.
func TestHostileTwoIdenticalPoisonsWedgeDestination(t *testing.T) {
	t.Parallel() // its own schema and relay: overlaps the other parallel tests
	s := newDB(t)
	insertN(t, s.DB, "orders", "poison-1", "poison-2")
	out := newOutage()
	out.failWith = func(_ string, m *message.Message) (bool, error) {
		if m.UUID == "poison-1" || m.UUID == "poison-2" {
			return false, errors.New("schema registry: incompatible schema")
		}
		return false, nil
	}
	poisonCalls := func() int {
		out.mu.Lock()
		defer out.mu.Unlock()
		return out.failed["poison-1"] + out.failed["poison-2"]
	}
	cfg := outageConfig()
	cfg.MaxAttempts = 4
	// A failure bound only, for a relay that stopped publishing
	// altogether: the test's deadline. The wait for the statuses below is
	// bounded by events.
	giveUp := await.Deadline(t)
	began := time.Now()
	rs := startRelays(t, s, out, 1, cfg)
	// Wait until both poisons were tried at least once.
	for {
		out.mu.Lock()
		n1, n2 := out.failed["poison-1"], out.failed["poison-2"]
		out.mu.Unlock()
		if n1 > 0 && n2 > 0 {
			break
		}
		require.False(t, time.Now().After(giveUp), "the poisons were never tried: %d and %d failed publishes", n1, n2)
		time.Sleep(5 * time.Millisecond)
	}
	fill(t, s, "orders", "good", 20)
	// Bounded by events: 40 failed publishes of the poisons after every
	// good row was delivered (from then on each one spends an attempt: 8
	// at most).
	goodsAt := -1 // failed publishes of the poisons when every good row was seen delivered
	settled, why := false, ""
	for {
		calls := poisonCalls() // before the statuses: a publish after them is counted next time
		st := statusCounts(t, s)
		if st["PUBLISHED"] == 20 && st["EXHAUSTED"] == 2 {
			settled = true
			break
		}
		if st["PUBLISHED"] == 20 && goodsAt < 0 {
			goodsAt = calls
		}
		if goodsAt >= 0 && calls-goodsAt > 40 {
			why = fmt.Sprintf("%d failed publishes of the poisons after every good row was delivered, without their budgets ending", calls-goodsAt)
			break
		}
		if time.Now().After(giveUp) {
			why = "the test's deadline came first"
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	rs.stop(t)
	st := statusCounts(t, s)
	p1, p2 := state(t, s.DB, "poison-1"), state(t, s.DB, "poison-2")
	delivered, _ := out.counts()
	t.Logf("settled %v after %s: %d failed publishes of the poisons (%d after the good rows were delivered), breaker seen open in %d of %d passes",
		settled, time.Since(began).Round(time.Millisecond), poisonCalls(), poisonCalls()-max(goodsAt, 0), rs.passesOpen("orders"), rs.passes())
	// Two messages failing the same way, alone in a pass, are what an
	// outage looks like to the default classifier, so the breaker may open
	// for a while; what must hold is that neither can hold it open: both end
	// EXHAUSTED within their budget and the good rows go out.
	require.True(t, settled, "%s: statuses %v, %d of 20 good rows delivered, poison-1 %+v, poison-2 %+v, breaker seen open: %v",
		why, st, delivered, p1, p2, rs.sawOpen("orders"))
	require.Equal(t, 4, p1.Attempts, "poison-1 spent its whole budget")
	require.Equal(t, 4, p2.Attempts, "poison-2 spent its whole budget")
}

// passes is how many reports the relays gave; passesOpen how many of them
// showed dest's breaker open (diagnostics).
func (rs *relaySet) passes() int {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return len(rs.reps)
}

func (rs *relaySet) passesOpen(dest string) int {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	n := 0
	for _, r := range rs.reps {
		for _, b := range r.OpenBreakers {
			if b.Destination == dest {
				n++
				break
			}
		}
	}
	return n
}

// Regression (hostile review): the default classifier, and a downstream that takes every message
// and then fails the call (the broker had it; the answer was lost: "connection
// reset after send"). The pass-wide evidence turns those ambiguous attempts
// into "unavailable" releases: no attempt is counted, so when the rows go out
// again they are not reported as possible duplicates although the broker got
// each of them twice. Guarantee: operators are told the truth (Report,
// logs); an ambiguous outcome is never silently dropped from the duplicate
// accounting.
func TestHostileAcceptedThenFailedRowsNotReportedAsDuplicates(t *testing.T) {
	s := newDB(t)
	fill(t, s, "orders", "m", 40)
	var lossy atomic.Bool
	lossy.Store(true)
	out := newOutage()
	out.failWith = func(_ string, m *message.Message) (bool, error) {
		if lossy.Load() {
			return true, errors.New("write tcp 10.0.0.7:5672: connection reset by peer after send")
		}
		return false, nil
	}
	rs := startRelays(t, s, out, 1, outageConfig())
	for !rs.sawOpen("orders") {
		time.Sleep(5 * time.Millisecond)
	}
	lossy.Store(false)
	for statusCounts(t, s)["PUBLISHED"] < 40 {
		time.Sleep(10 * time.Millisecond)
	}
	rs.stop(t)
	out.mu.Lock()
	twice := 0
	for _, n := range out.delivered {
		if n > 1 {
			twice++
		}
	}
	out.mu.Unlock()
	reported := rs.total(func(r forwarder.Report) int { return r.PossibleDuplicates })
	var zeroAttempts int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE attempts <= 1`).Scan(&zeroAttempts))
	require.Positive(t, twice, "the downstream got messages twice")
	require.Equal(t, twice, reported, "%d messages reached the broker twice, the reports counted %d possible duplicates (%d rows show attempts <= 1)", twice, reported, zeroAttempts)
}

// Regression (hostile review): a relay with a fixed Owner (a StatefulSet pod name) had a breaker
// open when its process was killed (no deferred cleanup ran), and restarts
// under the same owner with a healthy downstream. Run does not clear its
// owner's rows in messaging_relay_breaker at start, and its live heartbeat
// makes status show the dead process's breaker as open. Guarantee:
// operators are told the truth (outboxctl status).
func TestHostileRestartedRelayShowsItsPredecessorsBreaker(t *testing.T) {
	s := newDB(t)
	// What the killed process left behind.
	_, err := s.DB.Exec(`INSERT INTO messaging_relay_breaker (owner, destination, last_error)
		VALUES ('relay-0', 'orders', 'dial tcp 10.0.0.7:5672: connect: connection refused')`)
	require.NoError(t, err)
	fill(t, s, "orders", "m", 10)
	out := newOutage()
	cfg := outageConfig()
	cfg.Owner = "relay-0"
	rs := startRelays(t, s, out, 1, cfg)
	for statusCounts(t, s)["PUBLISHED"] < 10 {
		time.Sleep(5 * time.Millisecond)
	}
	require.False(t, rs.sawOpen("orders"))
	snap, err := status.Collect(context.Background(), s.DB)
	require.NoError(t, err)
	require.Empty(t, snap.Breakers, "the restarted relay delivers to orders, yet status reports its breaker open: %+v", snap.Breakers)
}

// Regression (hostile review): two relays, one destination, a broker outage that opens both
// relays' breakers, then recovery. The relay whose probe succeeds first
// drains the backlog; the other one's probes then find no row of the
// destination, so its breaker never closes: it stays "not ready" (Ready
// says every destination is unavailable) and status keeps listing its open
// breaker, on a healthy broker, until a row happens to come its way as a
// probe. Guarantee: operators are told the truth (Ready, status).
func TestHostileBreakerStaysOpenWhenAnotherRelayDrainedTheBacklog(t *testing.T) {
	s := newDB(t)
	s.DB.SetMaxOpenConns(12)
	s.DB.SetMaxIdleConns(12) // idle as many as open: no reconnect per statement (testdb.IdleConns)
	fill(t, s, "orders", "m", 400)
	out := newOutage("orders")
	cfg := outageConfig()
	cfg.BatchSize = 20
	rs := startRelays(t, s, out, 2, cfg)
	for rs.fs[0].Ready() == nil || rs.fs[1].Ready() == nil {
		time.Sleep(5 * time.Millisecond)
	}
	out.set("orders", false)
	for statusCounts(t, s)["PUBLISHED"] < 400 {
		time.Sleep(5 * time.Millisecond)
	}
	// Both relays become ready again once their probes find the backlog
	// gone (another relay delivered it): an open breaker with nothing of its
	// destination left closes.
	await.Until(t, func() bool {
		return rs.fs[0].Ready() == nil && rs.fs[1].Ready() == nil
	}, "the broker is back and the backlog is delivered, yet a relay reports not ready")
	// Ready follows the relay's breaker in memory, which closes just before
	// the relay deletes its row from the table status reads (breaker.go:
	// success, then breakerChanged's recordBreaker), so status may lag
	// Ready by that one statement: seen once in a CI run, on pgx, with the
	// row's owner already ready. Its row goes, as Ready did.
	await.Until(t, func() bool {
		snap, err := status.Collect(context.Background(), s.DB)
		return err == nil && len(snap.Breakers) == 0
	}, "the broker is back and the backlog is delivered, yet status lists open breakers")
	snap, err := status.Collect(context.Background(), s.DB)
	require.NoError(t, err)
	require.Empty(t, snap.Breakers)
}

// Regression (hostile review): an idle pass (nothing claimed) reports no open breakers even
// while the relay's breaker is open: Report.OpenBreakers is only filled when
// a pass wrote outcomes. Guarantee: the Report tells the truth.
func TestHostileIdleReportHidesOpenBreaker(t *testing.T) {
	s := newDB(t)
	fill(t, s, "orders", "m", 40)
	out := newOutage("orders")
	rs := startRelays(t, s, out, 1, outageConfig())
	for rs.fs[0].Ready() == nil {
		time.Sleep(5 * time.Millisecond)
	}
	rs.mu.Lock()
	from := len(rs.reps) // passes that ended after the breaker was seen open
	rs.mu.Unlock()
	// Collect passes until one claims nothing (every row of orders is
	// excluded from the claim and its probe is not due).
	for {
		rs.mu.Lock()
		var idle *forwarder.Report
		for i := from; i < len(rs.reps); i++ {
			if rs.reps[i].Claimed == 0 {
				idle = &rs.reps[i]
			}
		}
		var r forwarder.Report
		if idle != nil {
			r = *idle
		}
		rs.mu.Unlock()
		if idle != nil {
			require.Error(t, rs.fs[0].Ready(), "the breaker is still open")
			require.NotEmpty(t, r.OpenBreakers, "an idle pass while orders' breaker is open reports OpenBreakers %v", r.OpenBreakers)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A poison message alone in the outbox (default classifier): it ends
// EXHAUSTED after its budget and never opens the breaker. (Held.)
func TestHostilePoisonAloneExhausts(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "poison")
	out := newOutage()
	out.failWith = func(_ string, m *message.Message) (bool, error) {
		return false, errors.New("serializer: field 7 out of range")
	}
	cfg := outageConfig()
	cfg.MaxAttempts = 4
	rs := startRelays(t, s, out, 1, cfg)
	settled := waitSettledOrProbed(t, rs, "orders", 20, func() bool { return statusCounts(t, s)["EXHAUSTED"] == 1 })
	rs.stop(t)
	require.True(t, settled, "poison %+v", state(t, s.DB, "poison"))
	require.False(t, rs.sawOpen("orders"))
	require.Equal(t, 4, state(t, s.DB, "poison").Attempts)
}

// Regression (hostile review): a single poison message on a quiet destination, and one transient
// failure of one other message. The breaker counts consecutive failures
// across passes and remembers up to two message ids until a success: the
// poison's own retries make the count, the transient failure supplies the
// second id, and the breaker opens (observed: the breaker opens; every
// row of the destination then waits for probes, and whenever the poison is
// the probe its failure is taken as "failing like the outage", see
// TestHostilePoisonProbeAfterOutageStallsDestination).
// Guarantee: a poison message ends EXHAUSTED and never opens the breaker;
// committed messages are delivered.
func TestHostileOnePoisonAndOneTransientFailureWedgeDestination(t *testing.T) {
	t.Parallel() // its own schema and relay: overlaps the other parallel tests
	s := newDB(t)
	insertN(t, s.DB, "orders", "poison")
	out := newOutage()
	var qFailed atomic.Bool
	out.failWith = func(_ string, m *message.Message) (bool, error) {
		switch {
		case m.UUID == "poison":
			return false, errors.New("serializer: field 7 out of range")
		case m.UUID == "q" && qFailed.CompareAndSwap(false, true):
			return false, errors.New("write tcp 10.0.0.7:5672: broken pipe")
		}
		return false, nil
	}
	cfg := outageConfig()
	cfg.MaxAttempts = 25
	rs := startRelays(t, s, out, 1, cfg)
	for {
		out.mu.Lock()
		n := out.failed["poison"]
		out.mu.Unlock()
		if n >= 6 {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	insertN(t, s.DB, "orders", "q")
	for !qFailed.Load() {
		time.Sleep(2 * time.Millisecond)
	}
	fill(t, s, "orders", "good", 10)
	settled := waitSettledOrProbed(t, rs, "orders", 40, func() bool {
		st := statusCounts(t, s)
		return st["PUBLISHED"] == 11 && st["EXHAUSTED"] == 1
	})
	rs.stop(t)
	delivered, _ := out.counts()
	require.True(t, settled, "after 40 probes: statuses %v, %d of 11 rows delivered, poison %+v, breaker seen open %v",
		statusCounts(t, s), delivered, state(t, s.DB, "poison"), rs.sawOpen("orders"))
	require.False(t, rs.sawOpen("orders"), "one poison and one transient failure opened the breaker")
}
