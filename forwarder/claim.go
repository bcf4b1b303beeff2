// The claim: which rows a pass takes, from which start point, continuing
// which chains (see claimer.claim). It owns the statements that take rows
// and nothing that publishes or writes outcomes.

package forwarder

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// errClaimCut is what the statements of a claim after a failed one return
// without running.
var errClaimCut = errors.New("forwarder.claim: not run, an earlier statement of this claim failed")

// claimedBatch is the result of one claim and the local time just before
// it, which is where its rows' start-by deadline is measured from.
type claimedBatch struct {
	claimed   []fencing.Claimed
	claimedAt time.Time
	after     map[string]int64 // continued keys: the seq their chain continues
	probes    map[string]bool  // message ids claimed as breaker probes
	err       error
	failures  int       // claim statements that failed after they were sent
	released  int       // rows released because of them
	full      bool      // cut by its size or its byte budget: more may be claimable
	mem       *batchMem // claimed lives in mem.claimed; the pass gives mem back
}

// claim takes the next batch: unkeyed rows and chains, continuing the
// chains in cont (those of the batch in flight, for a claim made ahead) and
// resuming the keys this relay published in its last passes behind their
// last confirmed rows (chainLog.positions).
//
// It may take several statements. The first walks the ordering keys when it
// has no chain to continue or resume and keys had work at the last walk (or
// on every walkEvery-th claim, claimStart.walkDue), and on every
// walkEvery-th claim anyway (claimStart.fullWalkDue), which then resumes
// nothing: that claim finds a row that became claimable below a resumed
// key's position (a late commit, a redrive). A claim that walks is planned afresh by PostgreSQL
// when no key has work, which costs more than the claim itself, so a relay
// draining unkeyed rows claims them with the plain statement. When the first
// comes back short from its start point, the unkeyed rows below the start
// point are claimed; when it is still short and did not walk the keys, they
// are walked for the rest (so that a short batch still means nothing more
// was claimable). When it is still
// short and some chains stopped at the chain cap (a cap that spreads a
// batch over several keys when there are several), those chains are
// extended by the room left, so a few hot keys still fill a batch.
func (cl *claimer) claim(ctx context.Context, cont []fencing.Continuation) claimedBatch {
	if age, ttl, lapsed := cl.beat.lapsed(); lapsed {
		return claimedBatch{err: outbox.Errorf(CodeHeartbeatLapsed, "forwarder.claim",
			"no relay heartbeat succeeded for %s, longer than its lifetime %s: the database may have been switched to CDC meanwhile, so nothing is claimable until a heartbeat succeeds again (check the database connection)",
			age.Round(time.Millisecond), ttl)}
	}
	cl.claimMu.Lock()
	defer cl.claimMu.Unlock()
	cl.takePace()
	dbctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cl.dbTimeout)
	defer cancel()
	at := cl.localNow()
	defer cl.setClaiming(time.Time{}) // set by claimLanes
	// Every statement below may commit on the server and still fail here
	// (a row the client cannot read, the timeout, the connection lost
	// while reading). The rows of each one that succeeds are recorded as
	// held; after one that fails, every other row this owner holds is
	// released (releaseUnheld), so a claimed batch is never dropped to wait
	// for its leases to expire.
	var failures, released int
	defer func() {
		switch {
		case failures > 0:
			cl.budgetShift = min(cl.budgetShift+1, 40)
		case cl.budgetShift > 0:
			cl.budgetShift--
		}
	}()
	maxBytes := max(1, cl.cfg.MaxBatchBytes>>cl.budgetShift)
	// Every statement appends its rows to buf, the batch's memory; the
	// batch is buf in seq order (merged after each statement).
	mem := cl.takeMem()
	buf := mem.claimed[:0]
	if cap(buf) < cl.size {
		buf = make([]fencing.Claimed, 0, cl.size)
	}
	// Every statement has a byte budget (MaxBytes >= 1: the first
	// statement's is at least one byte, and the statements that complete a
	// batch run only while budget is left, strict once the batch holds rows:
	// a row larger than what is left waits for a claim of its own, where it
	// goes out alone).
	var lanes []int
	var laneCount int
	if cl.cfg.Fence == FenceLanes {
		var err error
		if lanes, laneCount, err = cl.claimLanes(dbctx, at); err != nil || len(lanes) == 0 {
			// Nothing to claim in, so no claim records rows below: forget
			// here what was held for more than a lease (an outcome write
			// that failed), as hold does for a claim. A relay whose share
			// fell to no lane at all otherwise held such a row for ever,
			// its marked lanes never settled, and it kept them all.
			cl.hold(nil, at)
			cl.giveMem(mem)
			return claimedBatch{claimedAt: at, err: err}
		}
		// Where this claim's descents of the lanes' index start: the
		// lanes' floors, raised beside the claims from time to time
		// (lanes.go).
		cl.advanceFloors(lanes, laneCount)
	}
	// The claim statements run on the claims' pinned connection (shared
	// with the outcome writes with ShareConnection), taken once the lanes'
	// upkeep (on the pool) is done.
	pc := cl.claimConn.take(dbctx)
	defer func() { cl.claimConn.give(pc) }() // after the batch's draining is known
	dbctx = withPinned(dbctx, pc)
	claimFn := func(p fencing.ClaimParams) ([]fencing.Claimed, error) {
		if failures > 0 {
			// One failed statement ends the claim: the rest would run past
			// the same deadline and each release again, so a claim is
			// bounded by DBTimeout plus one release, not by the number of
			// its statements (forwarder.Config.StopBound counts on it).
			return nil, errClaimCut
		}
		n := len(buf)
		var err error
		if lanes != nil {
			// What the earlier statements of this claim took is held now:
			// not claimed again, and recorded on the lanes with the rest.
			p.Lanes, p.LaneCount, p.HeldSeqs = lanes, laneCount, cl.heldSeqs()
		}
		if buf, err = fencing.ClaimAppend(dbctx, cl.q, buf, p); err != nil {
			if !errors.Is(err, fencing.ErrInvalidArgument) {
				failures++
				if lanes == nil { // a lane claim writes no row: nothing to release
					released += cl.releaseUnheld(ctx, err)
				}
			}
			return nil, err
		}
		rows := buf[n:len(buf):len(buf)]
		cl.hold(rows, at)
		return rows, nil
	}
	merge := func() []fencing.Claimed {
		buf = mergeBySeq(buf)
		return buf
	}
	from, cursor := cl.start.from(), cl.start.keyCursor()
	exclude, probes := cl.probes.forClaim()
	// Keys this relay published lately are resumed where their chains
	// ended, without looking for their heads (see chainLog), except on
	// every walkEvery-th claim, which walks every key.
	full := cl.start.fullWalkDue()
	var resume []fencing.Continuation
	// One key's chain is published one message at a time, so a claim
	// takes at most chainMax rows of a key (walked, continued or
	// extended), however large it grew. The walk takes at most a
	// Concurrency-th of the batch per key, so that a batch spreads over
	// several keys when there are several; chains cut there are extended
	// below when the batch is still short.
	limit := cl.size
	maxChain := min(cl.chainMax(), limit)
	chainCap := min(max(1, (limit+cl.cfg.Concurrency-1)/cl.cfg.Concurrency), maxChain)
	if !full {
		resume = cl.chains.positions(cont, 2*limit)
	}
	walk := full
	if len(cont)+len(resume) == 0 && !full {
		walk = cl.start.walkDue()
	}
	p := fencing.ClaimParams{
		Owner: cl.cfg.Owner, Limit: limit, Lease: cl.cfg.LeaseDuration,
		MaxAttempts: cl.cfg.MaxAttempts, Policy: cl.cfg.OrderingPolicy, Now: cl.dbNow(),
		FromSeq: from, KeyCursor: cursor, MaxChain: chainCap, MaxContinued: maxChain, Continue: append(cont[:len(cont):len(cont)], resume...),
		ExcludeDestinations: exclude, NoKeyWalk: !walk, MaxBytes: maxBytes,
	}
	claimed, err := claimFn(p)
	if err != nil {
		cl.start.record(p.FromSeq, p.Limit, nil, err)
		cl.giveMem(mem)
		return claimedBatch{claimedAt: at, err: err, failures: failures, released: released}
	}
	// What is left of the byte budget for the statements that complete the
	// batch (payloads only, as the client sees them: headers are small).
	budget := func() int64 { return maxBytes - payloadBytes(claimed) }
	if walk {
		cl.start.walked(fencing.NextKeyCursor(cursor, claimed, cont), hasKeyed(claimed))
	}
	unkeyedFrom := p.FromSeq
	if p.FromSeq > 0 && len(claimed) < p.Limit && budget() > 0 {
		// Nothing more at or above the start point: look below it before
		// calling the batch short, so that a short batch (which sends Run
		// to idle) always means the whole claimable index had no more. The
		// rows claimed above are IN_FLIGHT under this relay now, so this
		// claim cannot take them again.
		below := p
		below.Limit, below.FromSeq, below.NoKeyWalk, below.Continue = p.Limit-len(claimed), 0, true, nil
		below.MaxBytes, below.StrictBytes = budget(), len(claimed) > 0
		_, berr := claimFn(below)
		if berr != nil {
			// The rows claimed above the start are held and go on; record
			// makes the next claim start at the first entry.
			cl.logger.Error("Outbox claim below the start point failed", berr, watermill.LogFields{"held": len(claimed)})
		}
		claimed = merge()
		unkeyedFrom = 0 // this batch looked at the whole index
	}
	cl.start.record(unkeyedFrom, p.Limit, claimed, nil)
	if !walk && len(claimed) < p.Limit && budget() > 0 {
		// The batch is short without looking at keys: walk them for the
		// rest before calling it short, so that a short batch still means
		// nothing more was claimable.
		keyed := p
		keyed.Limit, keyed.FromSeq, keyed.NoKeyWalk, keyed.NoUnkeyed = p.Limit-len(claimed), 0, false, true
		keyed.Continue = cont // resumed keys were claimed above: walked again, their heads are held
		keyed.MaxBytes, keyed.StrictBytes = budget(), len(claimed) > 0
		rows, kerr := claimFn(keyed)
		if kerr != nil {
			cl.logger.Error("Outbox claim of keyed rows failed", kerr, watermill.LogFields{"held": len(claimed)})
		} else {
			cl.start.walked(fencing.NextKeyCursor(cursor, rows, nil), len(rows) > 0)
			claimed = merge()
		}
	}
	if ext := capped(claimed, chainCap, p.Continue); len(ext) > 0 && chainCap < maxChain && len(claimed) < p.Limit && budget() > 0 {
		room := p.Limit - len(claimed)
		more := p
		more.Limit, more.MaxChain, more.Continue = room, (room+len(ext)-1)/len(ext), ext
		more.MaxContinued = maxChain - chainCap // a capped chain holds chainCap rows already
		more.NoKeyWalk, more.NoUnkeyed, more.FromSeq, more.MaxBytes, more.StrictBytes = true, true, 0, budget(), true
		if _, xerr := claimFn(more); xerr != nil {
			cl.logger.Error("Outbox claim extending chains failed", xerr, watermill.LogFields{"held": len(claimed)})
		} else {
			claimed = merge()
		}
	}
	// A probe per open breaker whose probe is due: one row of its
	// destination, keyed or not.
	var probed map[string]bool
	for _, dest := range probes {
		pr := p
		pr.Limit, pr.MaxChain, pr.Continue, pr.FromSeq = 1, 1, nil, cl.probes.probeFrom(dest)
		pr.ExcludeDestinations, pr.OnlyDestination, pr.NoKeyWalk, pr.NoUnkeyed = nil, dest, false, false
		rows, perr := claimFn(pr)
		if perr == nil && len(rows) == 0 && pr.FromSeq > 1 {
			pr.FromSeq = 0 // past the last row: wrap around
			rows, perr = claimFn(pr)
		}
		if perr != nil {
			cl.logger.Error("Outbox breaker probe claim failed", perr, watermill.LogFields{"destination": dest})
			continue
		}
		if len(rows) == 0 {
			// Nothing of the destination waits (another relay delivered
			// it, or it was parked): an open breaker has nothing left to
			// protect. It closes; the next publish there tells again.
			cl.probes.probeNothing(dest)
			continue
		}
		cl.probes.probed(dest, rows[0].Row.Seq)
		for _, r := range rows {
			if probed == nil {
				probed = make(map[string]bool)
			}
			probed[r.Row.MessageID] = true
		}
		claimed = merge()
	}
	// Written under the claim's own deadline, shared with its statements:
	// however many breakers closed, the claim takes no longer (StopBound).
	cl.probes.writeBreakers(dbctx)
	var after map[string]int64
	for _, c := range p.Continue {
		if after == nil {
			after = make(map[string]int64, len(cont))
		}
		after[c.Key] = c.AfterSeq
	}
	n := len(claimed) - len(probed)
	cl.size = cl.nextSize(limit, n)
	mem.claimed = claimed
	more := cl.full(claimed, n, limit)
	cl.draining.Store(more)
	return claimedBatch{claimed: claimed, claimedAt: at, after: after, probes: probed, failures: failures, released: released,
		full: more, mem: mem}
}

// capped are the continuations of the chains the walk found that stopped at
// the cap (a continued chain, cont, is capped by the batch only).
func capped(claimed []fencing.Claimed, limit int, cont []fencing.Continuation) []fencing.Continuation {
	var rows map[string]int
	continued := keysOf(cont)
	for _, c := range claimed {
		k := c.Row.OrderingKey
		if k != "" && !continued[k] {
			if rows == nil {
				rows = make(map[string]int)
			}
			rows[k]++
		}
	}
	if rows == nil {
		return nil
	}
	return slices.DeleteFunc(continuations(claimed), func(c fencing.Continuation) bool { return rows[c.Key] < limit })
}

func hasKeyed(claimed []fencing.Claimed) bool {
	return slices.ContainsFunc(claimed, func(c fencing.Claimed) bool { return c.Row.OrderingKey != "" })
}

// mergeBySeq puts the batch buf in seq order after a claim statement
// appended its rows, and returns it. A row can be in it twice: its lease
// ran out between two statements (a stalled relay, a clock jump) and the
// later one claimed it again with a new token, or parked it. The batch
// keeps it once, as the later statement returned it: the earlier lease on
// it is stale, and two outcomes for one row would make the pass's whole
// outcome write refused.
func mergeBySeq(buf []fencing.Claimed) []fencing.Claimed {
	bySeq := func(x, y fencing.Claimed) int { return cmp.Compare(x.Row.Seq, y.Row.Seq) }
	// Each statement's rows come in seq order (fencing.ClaimAppend); when
	// they all lie above the rows before them, as they usually do, the
	// batch is in order already and its rows (large structs) stay put.
	if !slices.IsSortedFunc(buf, bySeq) {
		slices.SortStableFunc(buf, bySeq)
	}
	kept := buf[:0]
	for _, c := range buf {
		if n := len(kept); n > 0 && kept[n-1].Row.MessageID == c.Row.MessageID {
			kept[n-1] = c // the later statement's: the stable sort keeps it after the earlier
			continue
		}
		kept = append(kept, c)
	}
	clear(buf[len(kept):])
	return kept
}

// nextSize is the size of the claim after one of size limit that took n
// rows (breaker probes not counted). A claim that came back full doubles
// it, up to MaxBatchSize, when the doubled batch would be published within
// a quarter of its lease at the mean time a publish took lately, its rows
// Concurrency at a time (a key's chain, one message at a time, is sized
// apart: chainMax); a claim less than half full, or a pace at which even
// this size no longer fits, halves it, down to BatchSize. So a relay that
// keeps up claims BatchSize rows, and one that is behind claims up to
// MaxBatchSize, which costs less per row.
//
// "Fits" also means: twice the batch (the batch claimed ahead waits for
// the one before it) is published before the start-by deadline,
// LeaseDuration - 1.5 x PublishTimeout after the claim, which is shorter
// than a quarter of the lease when the lease is close to its minimum, 2 x
// PublishTimeout; rows not started by then are released without an
// attempt. And before any publish was timed (no pace yet: the claim ahead
// is made before the first batch's publishes end) a claim grows only from
// BatchSize, once.
func (cl *claimer) nextSize(limit, n int) int {
	window := cl.window()
	fits := func(size int) bool {
		serial := max(cl.cfg.BatchSize, (size+cl.cfg.Concurrency-1)/cl.cfg.Concurrency)
		return cl.pace*time.Duration(serial) <= window
	}
	grown := min(2*limit, cl.cfg.MaxBatchSize)
	switch {
	case n >= limit && grown > limit && fits(grown) && (cl.pace > 0 || limit == cl.cfg.BatchSize):
		return grown
	case n < limit/2 || !fits(limit):
		return max(cl.cfg.BatchSize, limit/2)
	}
	return limit
}

// takePace updates pace and slowest from the publishes timed since the
// last claim (none: they stay).
func (cl *claimer) takePace() {
	if mean, slowest := cl.paces.take(); mean > 0 {
		cl.pace, cl.slowest = mean, max(slowest, mean)
	}
}

// window is how long after its claim a batch's last publish may start: the
// rows must start before the start-by deadline (LeaseDuration - 1.5 x
// PublishTimeout after the claim), half of which a claim made ahead may
// spend waiting for the batch before it, and within a quarter of the
// lease.
func (cl *claimer) window() time.Duration {
	return min(cl.cfg.LeaseDuration/4, (cl.cfg.LeaseDuration-cl.cfg.PublishTimeout-cl.cfg.PublishTimeout/2)/2)
}

// chainMax is the most rows of one key a claim takes. A chain goes out
// one message at a time, possibly all to the slowest destination, so it
// is as many rows as that destination's mean publish time lately lets
// start within the window, between BatchSize and MaxBatchSize; BatchSize
// before any publish was timed. A hot key on a fast downstream is then
// claimed a thousand rows at a time, and one on a slow downstream in
// chains its pace can publish before their leases end.
func (cl *claimer) chainMax() int {
	if cl.slowest <= 0 {
		return cl.cfg.BatchSize
	}
	rows := int(min(cl.window()/cl.slowest, time.Duration(cl.cfg.MaxBatchSize)))
	return max(cl.cfg.BatchSize, rows)
}

// forget drops the chains of items (see returns).
func (cl *claimer) forget(items []*item) { cl.chains.forget(items) }

// endPass ends a pass for the chain log (chainLog.endPass).
func (cl *claimer) endPass() { cl.chains.endPass() }

// gaveBack makes the next claim start at the first entry (see returns).
func (cl *claimer) gaveBack() { cl.start.reset() }
