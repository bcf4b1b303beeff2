package forwarder

import (
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// The default classifier's pass-wide evidence of an outage (passEvidence),
// and the breakers' memory of the messages it excused, which keeps two
// poison messages failing alike from passing for an outage again and again.

// excuse is a message put back without an attempt as evidence that its
// destination was unavailable.
type excuse struct {
	text string // the error it failed with
	gen  uint64 // its destination's confirm generation when it was excused
}

// maxExcused bounds the excused messages remembered, all destinations
// together; when a new one would exceed it the memory is dropped whole. A
// forgotten excuse only makes the next failure of that message count as
// evidence again (the rule as it was without the memory): an outage never
// spends a budget for it, a pair of poison messages may cycle once more.
const maxExcused = 4096

// passEvidence applies the default classifier's pass-wide rule: when every
// publish of the pass to a destination failed ambiguously with the same
// error, on two messages or more (or on a probe, with the error that opened
// the breaker), the destination is taken to be unavailable: those rows are
// put back without an attempt and its breaker opens. Timeouts and panics
// are not evidence (the broker may have taken those messages), nor is a
// single message otherwise (a poison message fails alone), nor are messages
// that were each put back so before a later confirmed publish to the
// destination and fail again with the same error (poison messages failing
// alike, see passLikeOutage): those spend their attempts. It also counts the
// pass's confirmed publishes, which that rule reads.
func (x *executor) passEvidence(items []item) {
	if !x.cfg.defaultClassifier {
		return
	}
	x.breakers.confirmed(items)
	type tally struct {
		failed []*item
		text   string
		mixed  bool
	}
	var by map[string]*tally
	for i := range items {
		it := &items[i]
		if it.msg == nil || it.err == nil && it.outcome.To != envelope.StatusPublished {
			continue // not attempted
		}
		if by == nil {
			by = make(map[string]*tally)
		}
		dest := it.claimed.Row.Destination
		t := by[dest]
		if t == nil {
			t = &tally{}
			by[dest] = t
		}
		switch {
		case t.mixed:
		case it.outcome.Code != FailurePublishError || (it.outcome.To != envelope.StatusAmbiguous && it.outcome.To != envelope.StatusExhausted):
			t.mixed = true
		case len(t.failed) > 0 && errText(it.err) != t.text:
			t.mixed = true
		default:
			t.failed, t.text = append(t.failed, it), errText(it.err)
		}
	}
	for dest, t := range by {
		if t.mixed || len(t.failed) == 0 {
			continue
		}
		// One message alone is evidence only as a probe failing the way the
		// failure that opened the breaker did, the first time that message
		// is probed (otherwise a long outage would spend its probes'
		// budgets; a message probed again spends one). Two messages or more
		// are evidence unless each was excused before a later confirmed
		// publish to the destination (passLikeOutage).
		if len(t.failed) < 2 {
			if !t.failed[0].probe || !x.breakers.probeLikeOutage(dest, t.failed[0].claimed.Row.MessageID, t.text) {
				continue
			}
		} else {
			ids := make([]string, len(t.failed))
			for i, it := range t.failed {
				ids[i] = it.claimed.Row.MessageID
			}
			if !x.breakers.passLikeOutage(dest, t.text, ids) {
				continue
			}
		}
		hold := x.breakers.holdOff(dest, x.cfg.BreakerProbeBase)
		for _, it := range t.failed {
			// Back without an attempt, but remembered as possibly taken
			// (the default classifier cannot tell), and held off so that
			// probes take other rows.
			it.outcome = fencing.Outcome{To: envelope.StatusPending, Code: FailureDownstreamFailing,
				Detail:     "every publish to this destination in the pass failed the same way: " + t.text,
				RetryAfter: hold}
			it.unavailable = true
		}
		if x.breakers.trip(dest, t.text) {
			x.breakerChanged(dest, true, t.text)
		}
	}
}

// passLikeOutage reports whether a pass's failed publishes to dest, ids (two
// or more, every one ambiguous with errText), are evidence that dest is
// unavailable: unless each of them was excused with errText before a later
// confirmed publish to dest. Those messages fail on their own while dest
// takes others (two poison messages rejected alike, claimed together): each
// must spend its attempts, or they would trip the breaker again each time a
// probe closed it, and never spend their budgets. One message new to the
// memory (or excused since the last confirmed publish, or with another
// error) is enough for evidence: an outage that catches new messages puts
// them back without an attempt as before, also when it catches old ones
// with them, whatever the destination confirmed in between. When it is
// evidence, every id is remembered as excused.
func (b *breakers) passLikeOutage(dest, errText string, ids []string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	fresh := false
	for _, id := range ids {
		if !b.excusedBeforeLocked(dest, id, errText) {
			fresh = true
			break
		}
	}
	if !fresh {
		return false
	}
	for _, id := range ids {
		b.excuseLocked(dest, id, errText)
	}
	return true
}

// excusedBeforeLocked reports whether message id to dest was excused with
// errText before a later confirmed publish to dest (its excuse is stale: the
// destination has worked since, and the message fails as it did).
func (b *breakers) excusedBeforeLocked(dest, id, errText string) bool {
	e, ok := b.excused[dest][id]
	return ok && e.text == errText && e.gen < b.confirms[dest]
}

// excuseLocked remembers message id to dest as excused with errText now.
func (b *breakers) excuseLocked(dest, id, errText string) {
	m := b.excused[dest]
	if _, ok := m[id]; !ok {
		if b.nExcused >= maxExcused {
			clear(b.excused)
			b.nExcused, m = 0, nil
		}
		b.nExcused++
	}
	if m == nil {
		if b.excused == nil {
			b.excused = make(map[string]map[string]excuse)
		}
		m = make(map[string]excuse)
		b.excused[dest] = m
	}
	m[id] = excuse{text: errText, gen: b.confirms[dest]}
}

// confirmed records the confirmed publishes of a pass (items published:
// attempted, no error, PUBLISHED), under one lock: each moves its
// destination's confirm generation on (every excuse given before it becomes
// stale) and forgets its own message's excuse, if any. Unlike success it
// counts confirmed publishes only (success also closes a breaker whose
// probe found no row, which shows nothing about the destination).
//
// A generation is only ever compared with an excuse's, so a destination
// with no excuse keeps its count: an excuse given later records the count
// as it is, and the first confirm after it moves it on. While nothing is
// excused (nearly always), a pass costs the lock and nothing else.
func (b *breakers) confirmed(items []item) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i := 0; i < len(items) && b.nExcused > 0; i++ {
		it := &items[i]
		if it.msg == nil || it.err != nil || it.outcome.To != envelope.StatusPublished {
			continue
		}
		dest := it.claimed.Row.Destination
		m := b.excused[dest]
		if m == nil {
			continue
		}
		if b.confirms == nil {
			b.confirms = make(map[string]uint64)
		}
		b.confirms[dest]++
		if _, ok := m[it.claimed.Row.MessageID]; ok {
			delete(m, it.claimed.Row.MessageID)
			b.nExcused--
		}
		if len(m) == 0 {
			delete(b.excused, dest)
		}
	}
}
