// The executor's workers: they publish a pass's units on their own
// goroutines, with PublishTimeout, the drain deadline and panic recovery,
// and settle each publish (executor.classify, in classify.go, turns it into
// an outcome). They may not claim or write outcomes.

package forwarder

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// unit is what one worker publishes, in order: an unkeyed row, or the chain
// of one ordering key (its rows of the batch in seq order).
type unit struct {
	items []*item
	key   string // "" for an unkeyed row
	// after > 0: the chain continues one of this relay's chains of an
	// earlier batch that ended at this seq; it may go out only if that one
	// was confirmed to its end.
	after int64
}

// workers publish one pass's units, up to Concurrency at once, taking them
// in order. Within a chain one publish runs at a time, each waiting for the
// previous outcome; the first row that is not confirmed (ambiguous,
// rejected, timed out, not started) cuts the chain, and the rows behind it
// are released without an attempt, so no row of a key goes out after an
// earlier one that did not.
//
// A worker publishes on its own goroutine: no hand-off per message. When a
// publish overruns its PublishTimeout (or the drain deadline passes), the
// worker's goroutine is left inside the publisher and a new goroutine takes
// the worker's place at once: it settles the row as timed out, finishes the
// unit and goes on taking units. The goroutine left behind ends when the
// publisher returns, touching nothing of the pass.
type workers struct {
	x        *executor
	units    []unit
	taken    atomic.Int64
	wg       sync.WaitGroup // one per worker, whichever goroutine carries it
	startBy  time.Time
	stopping <-chan struct{}
	// calls holds each worker's publish in flight, for the drain deadline
	// to leave them all behind at once.
	calls   []atomic.Pointer[call]
	drained atomic.Bool
	// leftBehind: a publish of this pass was left running; its goroutine
	// read the pass's items and may still be inside the publisher, so the
	// batch's memory is not kept for another (see batchMem).
	leftBehind atomic.Bool
}

// publishAll publishes units and returns once each has its outcomes, and
// whether a publish was left running.
func (x *executor) publishAll(units []unit, startBy time.Time, stopping, drainExpired <-chan struct{}) (leftBehind bool) {
	n := min(x.cfg.Concurrency, len(units))
	w := &workers{x: x, units: units, startBy: startBy, stopping: stopping, calls: make([]atomic.Pointer[call], n)}
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-drainExpired:
			w.drained.Store(true)
			for i := range w.calls {
				if c := w.calls[i].Load(); c != nil {
					c.expire()
				}
			}
		case <-done:
		}
	}()
	w.wg.Add(n)
	for slot := range n {
		go w.work(slot)
	}
	w.wg.Wait()
	return w.leftBehind.Load()
}

// work takes units until none is left. It returns early, without ending
// the worker, when a publish was left behind: the worker goes on elsewhere.
func (w *workers) work(slot int) {
	for i := w.taken.Add(1) - 1; i < int64(len(w.units)); i = w.taken.Add(1) - 1 {
		if !w.publishUnit(slot, &w.units[i], 0, chainState{}) {
			return
		}
	}
	w.wg.Done()
}

// chainState is how far a unit got: cut once a row was not confirmed,
// through the seq (and throughID the message id) of its last confirmed row.
type chainState struct {
	cut       bool
	through   int64
	throughID string
}

// publishUnit publishes u's items from index from on. It reports false when
// a publish was left behind: the caller's goroutine must then return at
// once, the unit and the worker carry on in the goroutine that took over.
func (w *workers) publishUnit(slot int, u *unit, from int, st chainState) bool {
	x := w.x
	if from == 0 {
		st.cut = u.after > 0 && !x.chains.confirmedThrough(u.key, u.after)
	}
	for i := from; i < len(u.items); i++ {
		it := u.items[i]
		dest := it.claimed.Row.Destination
		switch {
		case st.cut:
			if it.msg != nil {
				it.outcome = fencing.Outcome{To: envelope.StatusPending}
			}
		case it.msg == nil:
			st.cut = true // parked by the claim, or unreadable: the key stops here
		case !it.probe && x.breakers.isOpen(dest):
			// The breaker opened while this batch was out: give the row
			// back untouched, it costs no attempt.
			it.outcome = fencing.Outcome{To: envelope.StatusPending, Code: FailureDownstreamUnavailable,
				Detail: "the destination's breaker is open: the downstream is unavailable"}
			it.unavailable, st.cut = true, true
		default:
			s, returned := w.publish(&call{w: w, slot: slot, u: u, at: i, st: st})
			if !returned {
				return false
			}
			st = w.settle(it, s, st)
		}
	}
	if u.key != "" {
		if st.cut {
			st.through = 0
		}
		x.chains.record(u.key, st.through, st.throughID)
	}
	return true
}

// settle gives it the outcome of s and updates its chain's state and its
// destination's breaker.
func (w *workers) settle(it *item, s sent, st chainState) chainState {
	x := w.x
	if !s.started {
		it.outcome = fencing.Outcome{To: envelope.StatusPending}
		st.cut = true
		return st
	}
	x.classify(it, s)
	dest := it.claimed.Row.Destination
	switch {
	case it.outcome.To == envelope.StatusPublished:
		st.through, st.throughID = it.claimed.Row.Seq, it.claimed.Row.MessageID
		if x.breakers.success(dest) {
			x.breakerChanged(dest, false, "")
		}
	case it.unavailable, it.err != nil && it.outcome.To != envelope.StatusFailed:
		// No answer about the message: unavailable, ambiguous, timed
		// out. (A rejection is the broker answering.)
		if x.breakers.failure(dest, it.claimed.Row.MessageID, errText(it.err)) {
			x.breakerChanged(dest, true, errText(it.err))
		}
		st.cut = true
	default:
		st.cut = true
	}
	return st
}

// sent is what became of one publish: not started (stopping, or too late
// for its lease), or the publisher's error with, for a publish that timed
// out or panicked, the failure code saying so.
type sent struct {
	started bool
	code    string
	err     error
}

// Publish states, arbitrated by compare-and-swap between the worker's
// goroutine and the watchdog: whoever moves a call out of running owns
// what follows.
const (
	running int32 = iota
	returned
	leftBehind
)

// producerSpan is the option of every publish span, made once (an option
// is an interface value: made per publish, it was an allocation each).
var producerSpan trace.SpanStartOption = trace.WithSpanKind(trace.SpanKindProducer)

var (
	errLeftBehind   = errors.New("publish left running when its context ended")
	errDrainExpired = errors.New("publish still running when the drain deadline passed")
)

// call is one publish in flight: item at of unit u, on worker slot, with
// the chain's state st before it.
type call struct {
	w      *workers
	slot   int
	u      *unit
	at     int
	st     chainState
	state  atomic.Int32
	span   trace.Span
	began  time.Time
	timer  *time.Timer
	cancel context.CancelFunc // ends the publish's context once it is left behind
}

// publish sends c's item downstream on the calling goroutine, under a span
// continuing the row's trace. It returns what became of it and true, or,
// when the publish overran PublishTimeout or the drain deadline, false once
// the publisher returns: by then a new goroutine has taken the worker's
// place (c.expire), and the caller must return at once.
func (w *workers) publish(c *call) (sent, bool) {
	x, it := w.x, c.u.items[c.at]
	row := &it.claimed.Row
	select {
	case <-w.stopping:
		return sent{}, true
	default:
	}
	// Not started, and given back without an attempt: the drain deadline
	// passed, the lease would not outlive the publish, or more publishes
	// than MaxAbandoned are already left running in a hanging downstream.
	if w.drained.Load() || x.localNow().After(w.startBy) || x.overloaded() {
		return sent{}, true
	}
	attempt := row.Attempts + 1
	ctx, span := x.tracer.Start(it.msg.Context(), x.spanName(row.Destination), producerSpan)
	if span.IsRecording() { // built only for a span that keeps them: this runs once per message
		span.SetAttributes(
			attribute.String("messaging.message.id", row.MessageID),
			attribute.String("messaging.destination.name", row.Destination),
			attribute.Int("outbox.attempt", attempt),
			attribute.Int64("outbox.lease_token", row.LeaseToken),
		)
	}
	ctx, cancel := context.WithTimeout(ctx, x.cfg.PublishTimeout)
	defer cancel()
	it.msg.SetContext(ctx)

	c.span, c.began, c.cancel = span, time.Now(), cancel
	w.calls[c.slot].Store(c)
	c.timer = time.AfterFunc(x.cfg.PublishTimeout, c.expire)
	if w.drained.Load() {
		// The drain deadline passed before this call was registered: it
		// is settled as timed out and the worker handed on, and the
		// publish never starts (Close may have returned already).
		c.expire()
		x.abandoned.Add(-1) // counted as left running by expire: it never ran
		return sent{}, false
	}
	err := publishRecovering(x.out, row.Destination, it.msg)
	if !c.state.CompareAndSwap(running, returned) {
		x.abandoned.Add(-1) // a publish left behind has returned
		return sent{}, false
	}
	c.timer.Stop()
	s := sent{started: true, err: err}
	if err != nil { // errors.As's target escapes: not on every publish
		var pe *panicError
		if errors.As(err, &pe) {
			s.code = FailurePublishPanic
		}
	}
	c.end(s)
	return s, true
}

// expire leaves c behind if it is still running: the row is settled as
// timed out and a new goroutine carries on with the worker's unit and the
// units after it.
func (c *call) expire() {
	w := c.w
	w.x.abandoned.Add(1) // before the swap: the publisher may return right after it
	if !c.state.CompareAndSwap(running, leftBehind) {
		w.x.abandoned.Add(-1)
		return
	}
	w.leftBehind.Store(true)
	c.cancel() // a publisher that honours its context stops sending
	s := sent{started: true, code: FailurePublishTimeout, err: fmt.Errorf("publish did not return within %s", w.x.cfg.PublishTimeout)}
	if w.drained.Load() {
		s.err = errDrainExpired
	}
	c.end(s)
	go func() {
		if w.publishUnit(c.slot, c.u, c.at+1, w.settle(c.u.items[c.at], s, c.st)) {
			w.work(c.slot)
		}
	}()
}

// end records the publish's time and ends its span.
func (c *call) end(s sent) {
	row := &c.u.items[c.at].claimed.Row
	took := time.Since(c.began)
	c.w.x.metrics.published(row.Destination, took)
	c.w.x.paces.add(row.Destination, took)
	if s.err != nil {
		c.span.RecordError(s.err)
		c.span.SetStatus(codes.Error, cmp.Or(s.code, "publish failed"))
	}
	c.span.End()
}

// publishRecovering is out.Publish with a panic turned into an error.
func publishRecovering(out message.Publisher, topic string, msg *message.Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v}
		}
	}()
	return out.Publish(topic, msg)
}

type panicError struct{ value any }

func (p *panicError) Error() string { return fmt.Sprintf("downstream publisher panicked: %v", p.value) }
