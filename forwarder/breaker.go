package forwarder

import (
	"slices"
	"sync"
	"time"
)

// breakers keeps one circuit breaker per destination: the relay's memory of
// "this downstream is down as a whole", which the attempt budget must not
// pay for.
//
// A breaker opens after BreakerThreshold consecutive publishes to its
// destination failed without an answer from the broker about the message
// (unavailable, ambiguous, timed out: not a rejection, which is the broker
// answering), spread over at least two messages, so that one poison message
// failing again and again never opens it. While it is open the relay claims
// no row of that destination and releases, without an attempt, the rows it
// still holds for it; every probe interval (BreakerProbeBase, doubling to
// BreakerProbeMax, jittered per owner) it claims a single row of the
// destination as a probe. A confirmed publish (a probe, or any other) closes
// it, and the backlog flows at full speed again. Owns nothing else: it never
// touches the database.
type breakers struct {
	mu        sync.Mutex
	threshold int
	base, max time.Duration
	jitter    func(base, ceiling time.Duration, n int) time.Duration
	now       func() time.Time
	m         map[string]*breaker
	seen      map[string]bool // destinations published to (or tried)
}

type breaker struct {
	failures int            // consecutive failures
	ids      map[string]int // messages among them (up to 2 tracked)
	open     bool
	openedAt time.Time
	probes   int       // probes sent since it opened
	nextAt   time.Time // when the next probe may be claimed
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
	x.failures++
	x.lastErr = errText
	if x.ids == nil {
		x.ids = make(map[string]int, 2)
	}
	if len(x.ids) < 2 {
		x.ids[id]++
	}
	if x.open {
		x.nextAt = b.now().Add(b.jitter(b.base, b.max, x.probes+1))
		return false
	}
	if x.failures >= b.threshold && len(x.ids) >= 2 {
		x.open, x.openedAt, x.probes = true, b.now(), 0
		x.nextAt = x.openedAt.Add(b.jitter(b.base, b.max, 1))
		return true
	}
	return false
}

// success records a confirmed publish to dest and reports whether it closed
// the breaker.
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
	x.open, x.openedAt, x.probes = true, b.now(), 0
	x.nextAt = x.openedAt.Add(b.jitter(b.base, b.max, 1))
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

// openWith reports whether dest's breaker is open and its last failure read
// errText.
func (b *breakers) openWith(dest, errText string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	x := b.m[dest]
	return x != nil && x.open && x.lastErr == errText
}
