// The completer: the fenced outcome write of a pass, its retry, and what
// the pass reports and logs about each row (stale leases included). It may
// not publish or claim.

package forwarder

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// completer is the last stage of a pass: it writes the outcomes the
// executor settled (fencing.Apply, retried), reports and logs each row,
// ends the pass (metrics, OnReport) and hands back to the claimer what the
// batch no longer holds.
type completer struct {
	*env
	claims   returns   // the claimer
	breakers *breakers // the executor's: the open ones go in each report
}

// returns is what the completer hands back to the claimer once a batch's
// outcomes are written (or failed to be).
type returns interface {
	// unhold forgets the rows whose outcomes were written.
	unhold(outcomes []fencing.Outcome)
	// forget drops the chains of items whose outcomes were not written, or
	// were stale: no claim may resume their keys behind them.
	forget(items []*item)
	// gaveBack says rows went back PENDING (released, unavailable), below
	// where the claims start.
	gaveBack()
	// giveMem takes the batch's memory back.
	giveMem(m *batchMem)
}

// writeOutcomes writes the outcomes of a pass's items, logs and counts them,
// ends the pass and gives the batch's memory back.
func (c *completer) writeOutcomes(ctx context.Context, t *tail, mem *batchMem) {
	defer c.claims.giveMem(mem)
	items := mem.items
	outcomes, written := mem.outcomes[:0], mem.written[:0]
	defer func() { mem.outcomes, mem.written = outcomes, written }()
	now := c.dbNow() // one clock for the batch: Apply writes it as one instant
	for i := range items {
		it := &items[i]
		if it.claimed.Held() {
			it.outcome.Lease = it.claimed.Lease
			it.outcome.Now = now
			outcomes = append(outcomes, it.outcome)
			written = append(written, it)
		}
	}
	// The outcome write gets its own timeout, started now: the publishes
	// may have taken longer than dbTimeout, and an outcome written on an
	// expired context would be lost (the rows would be published again
	// after their leases expire, until EXHAUSTED).
	dbctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.dbTimeout)
	defer cancel()
	results, err := c.apply(dbctx, outcomes)
	if err != nil {
		ids, tokens := make([]string, len(outcomes)), make([]int64, len(outcomes))
		for i, o := range outcomes {
			ids[i], tokens[i] = o.Lease.MessageID, o.Lease.Token
		}
		for _, it := range written {
			if it.verdict() == "published" {
				t.rep.UnrecordedPublishes++
			}
		}
		// Their keys may not be resumed behind these rows: they are not
		// PUBLISHED, and once their leases expire they are claimable again.
		c.claims.forget(written)
		c.logger.Error("Outbox outcomes not written: these rows stay IN_FLIGHT until their leases expire and are then claimed again, so those already published may be published twice", err, watermill.LogFields{
			"rows": len(outcomes), "message_ids": ids, "lease_tokens": tokens, "unrecorded_publishes": t.rep.UnrecordedPublishes,
		})
		c.end(t, outbox.Wrap(CodeOutcomesNotWritten, "forwarder.pass", err, fmt.Sprintf("write outcomes of %d rows", len(outcomes))))
		return
	}
	c.claims.unhold(outcomes)
	var stale map[*item]bool
	for i, r := range results {
		if r == fencing.Stale {
			if stale == nil {
				stale = make(map[*item]bool)
			}
			stale[written[i]] = true
		}
	}
	rep := &t.rep
	var unknown error
	for i := range items {
		it := &items[i]
		row := &it.claimed.Row
		verdict := it.verdict()
		if stale[it] {
			c.claims.forget([]*item{it})
			rep.Stale++
			c.metrics.message("stale", row.Destination)
			c.warn("Outbox lease lost before the outcome was written: possible duplicate publication", watermill.LogFields{
				"message_id": row.MessageID, "owner": it.claimed.Lease.Owner,
				"lease_token": it.claimed.Lease.Token, "destination": row.Destination, "outcome": verdict,
			})
			continue
		}
		switch verdict {
		case "published":
			rep.Published++
		case "ambiguous":
			rep.Ambiguous++
		case "failed":
			rep.Failed++
		case "exhausted":
			rep.Exhausted++
		case "released":
			rep.Released++
		case "unavailable":
			rep.Unavailable++
		}
		if verdict == "published" && (row.Attempts > 0 || row.LastFailureCode == FailureDownstreamFailing) {
			rep.PossibleDuplicates++
		}
		c.metrics.message(verdict, row.Destination)
		if it.unknown && unknown == nil {
			unknown = outbox.Errorf(CodeUnknownOutcome, "forwarder.pass",
				"the classifier returned an unknown outcome for row %s; it was recorded as AMBIGUOUS; fix the classifier to return Confirmed, Rejected or Ambiguous", row.MessageID)
		}
		if verdict == "ambiguous" || verdict == "failed" || (verdict == "exhausted" && it.claimed.Held()) {
			c.logger.Info("Outbox publish not confirmed", watermill.LogFields{
				"message_id": row.MessageID, "destination": row.Destination, "outcome": verdict,
				"code": it.outcome.Code, "attempt": row.Attempts + 1, "lease_token": it.claimed.Lease.Token,
				"retry_in": it.outcome.RetryAfter, "error": fmt.Sprint(it.err),
			})
		}
	}
	if rep.Released+rep.Unavailable > 0 {
		c.claims.gaveBack() // PENDING again, below where the claims start
	}
	c.end(t, unknown)
}

// apply writes the outcomes, trying again twice on a database error: the
// rows were published already, and an outcome lost now means the row is
// published again after its lease expires. The statement is atomic, so a
// retry never applies half a batch twice. (If the first try committed but its
// answer was lost, the retry reports the rows stale: a false alarm on the
// safe side.)
func (c *completer) apply(ctx context.Context, outcomes []fencing.Outcome) ([]fencing.Result, error) {
	var err error
	for try := range 3 {
		var res []fencing.Result
		// On the outcomes' pinned connection when it is free (with
		// ShareConnection, once the claim on it is done, for at most
		// pinShareWait); a failure that may have broken it gives it back
		// to the pool, so the next try takes another.
		pc := c.outcomeConn.take(ctx)
		res, err = fencing.Apply(withPinned(ctx, pc), c.q, outcomes)
		c.outcomeConn.give(pc)
		if err == nil || errors.Is(err, fencing.ErrInvalidArgument) {
			return res, err
		}
		c.logger.Error("Writing outcomes failed", err, watermill.LogFields{"try": try + 1, "rows": len(outcomes)})
		t := time.NewTimer(time.Duration(try+1) * 100 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
	}
	return nil, err
}

// end finishes a pass: metrics, OnReport, then the waiters.
func (c *completer) end(t *tail, err error) {
	t.rep.OpenBreakers = c.breakers.open()
	t.rep.Duration = time.Since(t.start)
	t.err = err
	c.metrics.pass(t.rep.Claimed, err != nil)
	c.metrics.contained(t.rep)
	if c.cfg.OnReport != nil {
		c.cfg.OnReport(t.rep)
	}
	close(t.done)
}
