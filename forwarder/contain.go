package forwarder

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// Containment (see the package documentation): what the relay does so that
// one failed claim, one huge batch or one hanging downstream costs no other
// row an attempt, and no unbounded memory or goroutines. The claimer's
// share of it is here: the batch's fullness, the rows it holds and the
// release after a failed claim (the executor pauses claims while too many
// publishes are left running: executor.claimPaused).

// full reports whether a claim of size limit that took n rows (breaker
// probes not counted) was cut by its size or (about: the statement counts
// headers too, as stored) by the byte budget, so more may be claimable at
// once.
func (cl *claimer) full(claimed []fencing.Claimed, n, limit int) bool {
	return n >= limit || payloadBytes(claimed) >= cl.cfg.MaxBatchBytes/2
}

func payloadBytes(claimed []fencing.Claimed) int64 {
	var n int64
	for _, c := range claimed {
		n += int64(len(c.Row.Payload))
	}
	return n
}

// heldRow is a row the relay holds: its seq and when it was claimed.
type heldRow struct {
	seq int64
	at  time.Time
}

// hold records the rows a claim returned IN_FLIGHT as this relay's, and
// forgets rows recorded more than a lease ago (their outcome write failed
// and their leases have expired since).
func (cl *claimer) hold(rows []fencing.Claimed, at time.Time) {
	cl.heldMu.Lock()
	defer cl.heldMu.Unlock()
	if cl.held == nil {
		cl.held = make(map[string]heldRow)
	}
	for id, h := range cl.held {
		if at.Sub(h.at) > cl.cfg.LeaseDuration {
			delete(cl.held, id)
		}
	}
	for _, c := range rows {
		if c.Held() {
			cl.held[c.Row.MessageID] = heldRow{seq: c.Row.Seq, at: at}
		}
	}
}

// unhold forgets the rows whose outcomes were written.
func (cl *claimer) unhold(outcomes []fencing.Outcome) {
	cl.heldMu.Lock()
	defer cl.heldMu.Unlock()
	for _, o := range outcomes {
		delete(cl.held, o.Lease.MessageID)
	}
}

// heldSeqs are the seqs of the rows the relay holds (a lane claim's
// ClaimParams.HeldSeqs).
func (cl *claimer) heldSeqs() []int64 {
	cl.heldMu.Lock()
	defer cl.heldMu.Unlock()
	seqs := make([]int64, 0, len(cl.held))
	for _, h := range cl.held {
		seqs = append(seqs, h.seq)
	}
	return seqs
}

func (cl *claimer) heldIDs() []string {
	cl.heldMu.Lock()
	defer cl.heldMu.Unlock()
	ids := make([]string, 0, len(cl.held))
	for id := range cl.held {
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
func (cl *claimer) releaseUnheld(ctx context.Context, cause error) int {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cl.dbTimeout)
	defer cancel()
	ids, err := fencing.ReleaseUnheld(rctx, cl.db, cl.cfg.Owner, cl.heldIDs())
	if err != nil {
		cl.logger.Error("Outbox rows of a failed claim not released; they are claimed again when their leases expire", err, watermill.LogFields{"claim_error": cause.Error()})
		return 0
	}
	if len(ids) > 0 {
		cl.warn("Outbox claim failed after it was sent; the rows it held were released without spending attempts", watermill.LogFields{
			"rows": len(ids), "message_ids": ids, "claim_error": cause.Error(),
		})
	}
	return len(ids)
}
