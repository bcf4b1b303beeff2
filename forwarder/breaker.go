package forwarder

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// breakers keeps one circuit breaker per destination: the relay's memory of
// "this downstream is down as a whole", which the attempt budget must not
// pay for.
//
// A breaker opens once BreakerThreshold distinct messages to its destination
// failed without an answer from the broker about them (unavailable,
// ambiguous, timed out: not a rejection, which is the broker answering) with
// no confirmed publish in between, so that one poison message failing again
// and again never opens it, however often it is retried. While it is open the relay claims
// no row of that destination and releases, without an attempt, the rows it
// still holds for it; every probe interval (BreakerProbeBase, doubling to
// BreakerProbeMax, jittered per owner) it claims a single row of the
// destination as a probe. A confirmed publish (a probe, or any other) closes
// it, and the backlog flows at full speed again.
//
// It also remembers, per destination and beyond the breaker's closing, the
// messages the default classifier's pass-wide rule excused (put back
// without an attempt as outage evidence: passEvidence, probeLikeOutage),
// with the error they failed with and the destination's count of confirmed
// publishes then. A message excused before a later confirmed publish to its
// destination, failing again with the same error, is no longer evidence of
// an outage: the destination works for other messages (excusedBeforeLocked).
// Owns nothing else: it never touches the database.
type breakers struct {
	mu        sync.Mutex
	threshold int
	base, max time.Duration
	jitter    func(base, ceiling time.Duration, n int) time.Duration
	now       func() time.Time
	m         map[string]*breaker
	seen      map[string]bool // destinations published to (or tried)
	// excused: destination -> message id -> why and when it was excused,
	// nExcused ids in all (at most maxExcused). confirms: destination ->
	// confirmed publishes counted so far (the confirm generation). None is
	// touched by success: they outlive the breaker.
	excused  map[string]map[string]excuse
	nExcused int
	confirms map[string]uint64
}

type breaker struct {
	ids      map[string]bool // distinct messages that failed since the last confirm (up to threshold)
	open     bool
	openedAt time.Time
	openErr  string          // the failure that opened it: what a probe failing "like the outage" must read
	probed   map[string]bool // messages a probe already carried while open
	probes   int             // probes sent since it opened
	probeSeq int64           // seq of the last probe: the next probe starts after it
	nextAt   time.Time       // when the next probe may be claimed
	lastErr  string
}

// BreakerState is one destination's open breaker, as a Report shows it.
type BreakerState struct {
	Destination string
	OpenedAt    time.Time
	NextProbeAt time.Time
	Probes      int
	LastError   string
}

func (b *breakers) get(dest string) *breaker {
	if b.m == nil {
		b.m = make(map[string]*breaker)
		b.seen = make(map[string]bool)
	}
	b.seen[dest] = true
	x := b.m[dest]
	if x == nil {
		x = &breaker{}
		b.m[dest] = x
	}
	return x
}

// failure records a publish to dest that got no answer about message id and
// reports whether it opened the breaker.
func (b *breakers) failure(dest, id, errText string) (opened bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	x := b.get(dest)
	x.lastErr = errText
	if x.ids == nil {
		x.ids = make(map[string]bool, b.threshold)
	}
	if len(x.ids) < b.threshold {
		x.ids[id] = true
	}
	if x.open {
		x.nextAt = b.now().Add(b.jitter(b.base, b.max, x.probes+1))
		return false
	}
	if len(x.ids) >= b.threshold {
		b.openLocked(x, errText)
		return true
	}
	return false
}

func (b *breakers) openLocked(x *breaker, errText string) {
	x.open, x.openedAt, x.openErr, x.probes, x.probed = true, b.now(), errText, 0, nil
	x.nextAt = x.openedAt.Add(b.jitter(b.base, b.max, 1))
}

// probeLikeOutage reports whether a probe of message id to dest failed the
// way the failure that opened its breaker did, for the first time for this
// message: evidence that the outage goes on, which spends no attempt (the
// message is remembered as excused). A message that a probe carried before
// in this outage and that fails again spends one (so a poison message that
// happens to fail like the outage still ends EXHAUSTED), and so does one
// excused with this error before a later confirmed publish to dest (the
// breaker's closing forgets which messages were probed; that memory stays).
func (b *breakers) probeLikeOutage(dest, id, errText string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	x := b.m[dest]
	if x == nil || !x.open || x.openErr != errText || x.probed[id] || b.excusedBeforeLocked(dest, id, errText) {
		return false
	}
	if x.probed == nil {
		x.probed = make(map[string]bool)
	}
	x.probed[id] = true
	b.excuseLocked(dest, id, errText)
	return true
}

// success records a confirmed publish to dest (or a probe that found no row
// of it) and reports whether it closed the breaker. It forgets the breaker,
// not the excused messages (see confirmed).
func (b *breakers) success(dest string) (closed bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.seen == nil {
		b.seen = make(map[string]bool)
	}
	b.seen[dest] = true
	x := b.m[dest]
	if x == nil {
		return false
	}
	closed = x.open
	delete(b.m, dest)
	return closed
}

// trip opens dest's breaker at once (the evidence of a whole pass) and
// reports whether it was closed before.
func (b *breakers) trip(dest, errText string) (opened bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	x := b.get(dest)
	x.lastErr = errText
	if x.open {
		return false
	}
	b.openLocked(x, errText)
	return true
}

// allOpen returns the open breakers and whether they cover every
// destination seen.
func (b *breakers) allOpen() ([]BreakerState, bool) {
	open := b.open()
	b.mu.Lock()
	defer b.mu.Unlock()
	return open, len(open) > 0 && len(open) == len(b.seen)
}

// isOpen reports whether dest's breaker is open.
func (b *breakers) isOpen(dest string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	x := b.m[dest]
	return x != nil && x.open
}

// forClaim returns the destinations a claim must leave out (every open
// breaker) and, among them, those whose probe is due; a due probe is counted
// as sent and the next one scheduled, so a claim made ahead does not probe
// twice.
func (b *breakers) forClaim() (exclude, probe []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	for dest, x := range b.m {
		if !x.open {
			continue
		}
		exclude = append(exclude, dest)
		if !now.Before(x.nextAt) {
			probe = append(probe, dest)
			x.probes++
			x.nextAt = now.Add(b.jitter(b.base, b.max, x.probes+1))
		}
	}
	slices.Sort(exclude)
	slices.Sort(probe)
	return exclude, probe
}

// nextProbe is the earliest time a probe falls due (zero: no breaker open).
func (b *breakers) nextProbe() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	var next time.Time
	for _, x := range b.m {
		if x.open && (next.IsZero() || x.nextAt.Before(next)) {
			next = x.nextAt
		}
	}
	return next
}

// open lists the open breakers, by destination.
func (b *breakers) open() []BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []BreakerState
	for dest, x := range b.m {
		if x.open {
			out = append(out, BreakerState{Destination: dest, OpenedAt: x.openedAt, NextProbeAt: x.nextAt, Probes: x.probes, LastError: x.lastErr})
		}
	}
	slices.SortFunc(out, func(a, c BreakerState) int {
		switch {
		case a.Destination < c.Destination:
			return -1
		case a.Destination > c.Destination:
			return 1
		}
		return 0
	})
	return out
}

// holdOff is how long a row put back because dest is unavailable waits
// before it is claimable again: at least base, and as long as the breaker
// has been open, so that probes take other rows and a row is probed again
// only at exponentially growing intervals while an outage lasts.
func (b *breakers) holdOff(dest string, base time.Duration) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	x := b.m[dest]
	if x == nil || !x.open {
		return base
	}
	return max(base, b.now().Sub(x.openedAt))
}

// probeFrom is where dest's next probe starts (after the last probe's row,
// so that probes rotate through the backlog instead of retrying one row).
func (b *breakers) probeFrom(dest string) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	if x := b.m[dest]; x != nil {
		return x.probeSeq + 1
	}
	return 0
}

// probed records the seq of the row a probe of dest carried (0: none found,
// start from the beginning next time).
func (b *breakers) probed(dest string, seq int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if x := b.m[dest]; x != nil {
		x.probeSeq = seq
	}
}

// breakerChanged reports a breaker's change of state: once per change, never
// per message. The metric and the log are at once; the database writes wait
// in x.changes for writeBreakers, after the publishes of the pass (or at the
// end of the claim) that saw the change.
func (x *executor) breakerChanged(dest string, open bool, why string) {
	x.metrics.breaker(dest, open)
	x.changes.add(breakerChange{dest: dest, open: open, why: why})
	if open {
		x.logger.Error("Outbox destination unavailable: breaker open; its rows wait without spending attempts, probing with one row at a time", nil,
			watermill.LogFields{"destination": dest, "error": why})
		return
	}
	x.logger.Info("Outbox destination available again: breaker closed", watermill.LogFields{"destination": dest})
}

// breakerChange is one breaker's change of state, to be written.
type breakerChange struct {
	dest string
	open bool
	why  string
}

// breakerChanges collects breaker changes not written yet, in the order they
// happened (a pass's workers and a claim's probes add theirs concurrently).
type breakerChanges struct {
	mu   sync.Mutex
	list []breakerChange
}

func (c *breakerChanges) add(ch breakerChange) {
	c.mu.Lock()
	c.list = append(c.list, ch)
	c.mu.Unlock()
}

// pending reports whether a change waits to be written (a pass without one
// starts no deadline).
func (c *breakerChanges) pending() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.list) > 0
}

func (c *breakerChanges) take() []breakerChange {
	c.mu.Lock()
	defer c.mu.Unlock()
	list := c.list
	c.list = nil
	return list
}

// writeBreakers writes the changes not written yet, in order, under ctx: one
// deadline for all of them however many destinations changed (a pass gives
// them 2 x DBTimeout, a claim what is left of its own DBTimeout), so a stop
// waits for them once, not once per destination (StopBound). For each
// change the breaker row (recordBreaker) and, on closing, the rows held off
// during the outage (endHoldOff). Best effort: a write that fails or finds
// the deadline passed is logged, and the next is tried.
func (x *executor) writeBreakers(ctx context.Context) {
	for _, ch := range x.changes.take() {
		x.recordBreaker(ctx, ch.dest, ch.open, ch.why)
		if !ch.open {
			x.endHoldOff(ctx, ch.dest)
		}
	}
}

// endHoldOff makes dest's rows that were put back during its outage
// claimable at once when its breaker closes: their hold-off (as long as the
// breaker had been open) only spread the probes over the backlog, and
// without this a row given back late in a long outage would wait out most
// of that outage's length again after the downstream is back (measured: a
// 60 s outage emptied 45.6 s after recovery, 1.8 s of it draining). Best
// effort: a failure is logged, and the rows come due on their own. The
// statement is fencing's (fencing.EndHoldOff).
func (x *executor) endHoldOff(ctx context.Context, dest string) {
	codes := [2]string{FailureDownstreamUnavailable, FailureDownstreamFailing}
	if _, err := fencing.EndHoldOff(ctx, x.db, dest, codes, x.dbNow()); err != nil {
		x.logger.Error("Outbox rows held off during an outage not made claimable; they come due on their own", err, watermill.LogFields{"destination": dest})
	}
}

// recordBreaker writes the change to messaging_relay_breaker for operators
// (outboxctl status), under Run only (a relay with a heartbeat); best effort,
// a failure is logged.
func (x *executor) recordBreaker(ctx context.Context, dest string, open bool, why string) {
	if !x.beat.underRun() {
		return
	}
	var err error
	if open {
		_, err = x.db.ExecContext(ctx, `INSERT INTO messaging_relay_breaker (owner, destination, last_error)
VALUES ($1, $2, nullif($3, ''))
ON CONFLICT (owner, destination) DO UPDATE SET opened_at = now(), last_error = excluded.last_error`,
			x.cfg.Owner, dest, fencing.CleanText(why, fencing.MaxFailureDetail))
	} else {
		_, err = x.db.ExecContext(ctx, `DELETE FROM messaging_relay_breaker WHERE owner = $1 AND destination = $2`, x.cfg.Owner, dest)
	}
	if err != nil {
		x.logger.Error("Outbox breaker state not recorded for operators", err, watermill.LogFields{"destination": dest, "open": open})
	}
}

// Ready reports whether the relay can deliver anything: an error with code
// FORWARDER_DOWNSTREAM_UNAVAILABLE naming the destinations when the breaker
// of every destination it has published to is open. The relay is alive
// meanwhile (it probes), but not ready.
func (f *Forwarder) Ready() error {
	if open, all := f.executor.breakers.allOpen(); all {
		names := make([]string, len(open))
		for i, b := range open {
			names[i] = b.Destination
		}
		return outbox.Errorf(CodeDownstreamUnavailable, "forwarder.Ready",
			"every destination this relay publishes to is unavailable (breaker open: %v); it probes them and resumes on its own", names)
	}
	return nil
}
