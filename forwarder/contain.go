package forwarder

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// Containment (see the package documentation): what the relay does so that
// one failed claim, one huge batch or one hanging downstream costs no other
// row an attempt, and no unbounded memory or goroutines. Forwarder.claim and
// Forwarder.pass call these.

// full reports whether a claim of size limit that took n rows (breaker
// probes not counted) was cut by its size or (about: the statement counts
// headers too, as stored) by the byte budget, so more may be claimable at
// once.
func (f *Forwarder) full(claimed []fencing.Claimed, n, limit int) bool {
	return n >= limit || payloadBytes(claimed) >= f.cfg.MaxBatchBytes/2
}

func payloadBytes(claimed []fencing.Claimed) int64 {
	var n int64
	for _, c := range claimed {
		n += int64(len(c.Row.Payload))
	}
	return n
}

// hold records the rows a claim returned IN_FLIGHT as this relay's, and
// forgets rows recorded more than a lease ago (their outcome write failed
// and their leases have expired since).
func (f *Forwarder) hold(rows []fencing.Claimed, at time.Time) {
	f.heldMu.Lock()
	defer f.heldMu.Unlock()
	if f.held == nil {
		f.held = make(map[string]time.Time)
	}
	for id, when := range f.held {
		if at.Sub(when) > f.cfg.LeaseDuration {
			delete(f.held, id)
		}
	}
	for _, c := range rows {
		if c.Held() {
			f.held[c.Row.MessageID] = at
		}
	}
}

// unhold forgets the rows whose outcomes were written.
func (f *Forwarder) unhold(outcomes []fencing.Outcome) {
	f.heldMu.Lock()
	defer f.heldMu.Unlock()
	for _, o := range outcomes {
		delete(f.held, o.Lease.MessageID)
	}
}

func (f *Forwarder) heldIDs() []string {
	f.heldMu.Lock()
	defer f.heldMu.Unlock()
	ids := make([]string, 0, len(f.held))
	for id := range f.held {
		ids = append(ids, id)
	}
	return ids
}

// releaseUnheld runs after a claim statement failed once it was sent: the
// server may have committed it, and then holds rows IN_FLIGHT under this
// owner that the relay never read. It releases every IN_FLIGHT row of this
// owner that the relay does not hold (claims run one at a time, so those are
// exactly the failed statement's rows), without spending attempts, best
// effort: when the release fails too, the leases expire as before. It
// returns how many rows it released.
func (f *Forwarder) releaseUnheld(ctx context.Context, cause error) int {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
	defer cancel()
	ids, err := fencing.ReleaseUnheld(rctx, f.db, f.cfg.Owner, f.heldIDs())
	if err != nil {
		f.logger.Error("Outbox rows of a failed claim not released; they are claimed again when their leases expire", err, watermill.LogFields{"claim_error": cause.Error()})
		return 0
	}
	if len(ids) > 0 {
		f.warn("Outbox claim failed after it was sent; the rows it held were released without spending attempts", watermill.LogFields{
			"rows": len(ids), "message_ids": ids, "claim_error": cause.Error(),
		})
	}
	return len(ids)
}
