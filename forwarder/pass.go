// A pass: one claimed batch turned into units, published, and handed to
// the completer; pipelining (a batch claimed ahead, the previous outcome
// write still running) is decided here. It owns the pass's items and their
// verdicts, not the statements.

package forwarder

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// item is one claimed row on its way through a pass.
type item struct {
	claimed *fencing.Claimed // in the claimed batch, which outlives the pass
	msg     *message.Message
	outcome fencing.Outcome
	err     error // the publish error, for the log
	unknown bool  // classifier returned an unknown Outcome
	probe   bool  // claimed as its destination's breaker probe
	// unavailable: put back without an attempt because the downstream was
	// unavailable as a whole.
	unavailable bool
}

// verdict names what happened to the row, for logs and metrics: derived from
// the outcome to be written (or, for a row the claim parked, from that).
func (it *item) verdict() string {
	if !it.claimed.Held() {
		return "exhausted" // parked by the claim
	}
	switch it.outcome.To {
	case envelope.StatusPublished:
		return "published"
	case envelope.StatusAmbiguous:
		return "ambiguous"
	case envelope.StatusFailed:
		return "failed"
	case envelope.StatusExhausted:
		return "exhausted"
	case envelope.StatusPending:
		if it.unavailable {
			return "unavailable"
		}
		return "released"
	}
	return "unknown"
}

// tail is the second half of a pass: writing its outcomes and reporting.
// Under Run it may still be running while the next pass publishes.
type tail struct {
	ahead bool // its batch was claimed ahead, while the previous one was in flight
	full  bool // its claim was cut by BatchSize or (about) by MaxBatchBytes: more may wait
	start time.Time
	rep   Report // rep.Claimed is set before the tail can run behind: the loop reads it
	err   error
	done  chan struct{} // closed once rep and err are final
}

// wait returns the pass's report once its outcomes are written (at once for
// a nil tail).
func (t *tail) wait() (Report, error) {
	if t == nil {
		return Report{}, nil
	}
	<-t.done
	return t.rep, t.err
}

// pass claims a batch (or takes the one claimed ahead, pre), publishes it
// and writes its outcomes. A pass given pre always consumes it, also when
// stopping (its rows are then released, not published).
//
// With prefetch set and a full batch claimed, it pipelines: it starts
// claiming the next batch on another connection right away and returns it
// as next, and it returns before its outcomes are written, so the caller
// publishes next while this pass's outcome statement runs (the returned
// tail; the caller hands it to the next pass as behind). Outcome statements
// still run one at a time and in pass order: a pass waits for behind before
// writing its own. Neither can reorder a key: a batch's rows stay
// IN_FLIGHT (not PUBLISHED) until its outcome statement commits, and while
// they do the claim returns no later row of their keys. Nor does it change
// what a crash leaves: outcomes are written as soon as the batch's publishes
// end, exactly as without pipelining; what no longer waits for them is the
// next batch's publishing.
//
// Without a batch claimed ahead (next nil) the returned tail is finished.
func (f *Forwarder) pass(ctx context.Context, stopping, drainExpired <-chan struct{}, pre <-chan claimedBatch, prefetch bool, behind *tail) (t *tail, next <-chan claimedBatch) {
	t = &tail{start: time.Now(), done: make(chan struct{}), ahead: pre != nil}
	var b claimedBatch
	if pre != nil {
		b = <-pre
	} else {
		select {
		case <-stopping:
			behind.wait()
			f.completer.end(t, nil)
			return t, nil
		default:
		}
		if f.executor.claimPaused(t) {
			behind.wait()
			f.completer.end(t, nil)
			return t, nil
		}
		b = f.claimer.claim(ctx, nil)
	}
	t.rep.AbandonedPublishes = max(t.rep.AbandonedPublishes, int(f.executor.leftRunning()))
	t.rep.ClaimFailures, t.rep.ClaimReleased = b.failures, b.released
	claimed := b.claimed
	if b.err != nil || len(claimed) == 0 {
		f.claimer.giveMem(b.mem)
		behind.wait()
		f.completer.end(t, b.err)
		return t, nil
	}
	t.rep.Claimed = len(claimed)
	t.full = b.full
	if prefetch && t.full && !f.executor.overloaded() {
		select {
		case <-stopping:
		default:
			ch := make(chan claimedBatch, 1) // buffered: the claim never waits for its reader
			cont := continuations(claimed)
			go func() { ch <- f.claimer.claim(ctx, cont) }()
			next = ch
		}
	}
	// No publish starts unless it can end (PublishTimeout) and its outcome
	// be written (a margin of half a PublishTimeout) before the lease
	// expires; measured on the local clock from just before this batch's own
	// claim (a prefetched batch waited for the previous pass meanwhile), so
	// clock skew with the database cannot stretch it.
	startBy := b.claimedAt.Add(f.cfg.LeaseDuration - f.cfg.PublishTimeout - f.cfg.PublishTimeout/2)

	items, ptrs := b.mem.itemsFor(len(claimed))
	units := b.mem.units[:0]
	var chainOf map[string]int // ordering key -> its unit
	for i := range claimed {
		c, it := &claimed[i], ptrs[i]
		it.claimed, it.probe = c, b.probes[c.Row.MessageID]
		switch {
		case !c.Held():
			// Parked by the claim: an expired lease spent the budget
			// (LEASE_EXPIRED), or the budget was already spent (BUDGET_SPENT).
			f.logger.Error("Outbox row exhausted by the claim", nil, watermill.LogFields{
				"message_id": c.Row.MessageID, "destination": c.Row.Destination, "attempts": c.Row.Attempts,
				"code": c.Row.LastFailureCode,
			})
		case c.Err != nil:
			f.park(it, c.Err)
		default:
			msg, err := envelope.ToMessage(c.Row, envelope.Options{Producer: f.cfg.Producer})
			if err != nil {
				f.park(it, err)
				break
			}
			it.msg = msg
		}
		key := c.Row.OrderingKey
		if key == "" {
			if it.msg != nil {
				units = append(units, unit{items: ptrs[i : i+1 : i+1]})
			}
			continue
		}
		// A key's rows stay together, in seq order (Claim returns them so),
		// rows that will not be published included: they end the chain.
		u, seen := chainOf[key]
		if !seen {
			if chainOf == nil {
				chainOf = make(map[string]int)
			}
			u = len(units)
			chainOf[key] = u
			units = append(units, unit{key: key, after: b.after[key]})
		}
		units[u].items = append(units[u].items, it)
	}
	t.rep.Chains = len(chainOf)
	b.mem.units = units

	if f.executor.publishAll(units, startBy, stopping, drainExpired) {
		b.mem.keep = false
	}
	f.claimer.endPass()
	f.executor.passEvidence(items)
	// The pass's breaker changes, however many destinations changed, share
	// one deadline: a stop waits for them once (StopBound).
	if f.executor.changes.pending() {
		bctx, bcancel := context.WithTimeout(context.Background(), 2*f.dbTimeout)
		f.executor.writeBreakers(bctx)
		bcancel()
	}

	behind.wait()
	if next == nil {
		f.completer.writeOutcomes(ctx, t, b.mem)
		return t, nil
	}
	go f.completer.writeOutcomes(ctx, t, b.mem)
	return t, next
}

// park records a row that cannot become a message (corrupt headers, a
// reserved header name) as FAILED: retrying would fail the same way forever.
func (f *Forwarder) park(it *item, err error) {
	code := string(outbox.CodeOf(err))
	if code == "" {
		code = string(outbox.CodeCorruptRow)
	}
	it.err = err
	it.outcome = fencing.Outcome{To: envelope.StatusFailed, Code: code, Detail: err.Error()}
}
