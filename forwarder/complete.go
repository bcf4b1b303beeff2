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

// writeOutcomes writes the outcomes of a pass's items, logs and counts them,
// ends the pass and gives the batch's memory back.
func (f *Forwarder) writeOutcomes(ctx context.Context, t *tail, mem *batchMem) {
	defer f.giveMem(mem)
	items := mem.items
	outcomes, written := mem.outcomes[:0], mem.written[:0]
	defer func() { mem.outcomes, mem.written = outcomes, written }()
	now := f.dbNow() // one clock for the batch: Apply writes it as one instant
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
	dbctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
	defer cancel()
	results, err := f.apply(dbctx, outcomes)
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
		f.chains.forget(written)
		f.logger.Error("Outbox outcomes not written: these rows stay IN_FLIGHT until their leases expire and are then claimed again, so those already published may be published twice", err, watermill.LogFields{
			"rows": len(outcomes), "message_ids": ids, "lease_tokens": tokens, "unrecorded_publishes": t.rep.UnrecordedPublishes,
		})
		f.end(t, outbox.Wrap(CodeOutcomesNotWritten, "forwarder.pass", err, fmt.Sprintf("write outcomes of %d rows", len(outcomes))))
		return
	}
	f.unhold(outcomes)
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
			f.chains.forget([]*item{it})
			rep.Stale++
			f.metrics.message("stale", row.Destination)
			f.warn("Outbox lease lost before the outcome was written: possible duplicate publication", watermill.LogFields{
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
		f.metrics.message(verdict, row.Destination)
		if it.unknown && unknown == nil {
			unknown = outbox.Errorf(CodeUnknownOutcome, "forwarder.pass",
				"the classifier returned an unknown outcome for row %s; it was recorded as AMBIGUOUS; fix the classifier to return Confirmed, Rejected or Ambiguous", row.MessageID)
		}
		if verdict == "ambiguous" || verdict == "failed" || (verdict == "exhausted" && it.claimed.Held()) {
			f.logger.Info("Outbox publish not confirmed", watermill.LogFields{
				"message_id": row.MessageID, "destination": row.Destination, "outcome": verdict,
				"code": it.outcome.Code, "attempt": row.Attempts + 1, "lease_token": it.claimed.Lease.Token,
				"retry_in": it.outcome.RetryAfter, "error": fmt.Sprint(it.err),
			})
		}
	}
	if rep.Released+rep.Unavailable > 0 {
		f.start.reset() // PENDING again, below where the claims start
	}
	f.end(t, unknown)
}

// apply writes the outcomes, trying again twice on a database error: the
// rows were published already, and an outcome lost now means the row is
// published again after its lease expires. The statement is atomic, so a
// retry never applies half a batch twice. (If the first try committed but its
// answer was lost, the retry reports the rows stale: a false alarm on the
// safe side.)
func (f *Forwarder) apply(ctx context.Context, outcomes []fencing.Outcome) ([]fencing.Result, error) {
	var err error
	for try := range 3 {
		var res []fencing.Result
		if res, err = fencing.Apply(ctx, f.q, outcomes); err == nil || errors.Is(err, fencing.ErrInvalidArgument) {
			return res, err
		}
		f.logger.Error("Writing outcomes failed", err, watermill.LogFields{"try": try + 1, "rows": len(outcomes)})
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

// Warner is implemented by loggers that have a warning level; watermill's
// LoggerAdapter has none, so warnings go to Info with severity=warn
// otherwise.
type Warner interface {
	Warn(msg string, fields watermill.LogFields)
}

func (e *env) warn(msg string, fields watermill.LogFields) {
	fields = watermill.LogFields{"owner": e.cfg.Owner}.Add(fields)
	if w, ok := e.baseLogger.(Warner); ok {
		w.Warn(msg, fields)
		return
	}
	e.logger.Info(msg, fields.Add(watermill.LogFields{"severity": "warn"}))
}
