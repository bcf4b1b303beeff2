// The lanes this relay owns (Config.Fence = FenceLanes): taking and renewing
// them, the order its claims serve them in, and giving back the lanes over
// its fair share once it finished what it holds in them.

package forwarder

import (
	"context"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// laneKeeper is the relay's view of its lanes (guarded by mu).
type laneKeeper struct {
	entered   bool // the fleet's fence was set to lanes (fencing.EnterFence)
	total     int  // the table's lane count
	share     int  // this relay's fair share at the last renewal
	owned     []fencing.LaneLease
	renewedAt time.Time         // local time just before the last successful renewal was sent
	tried     time.Time         // local time of the last renewal tried
	draining  map[int]time.Time // lanes over the share: no more claims there since then
	turn      int               // rotates the order the lanes' unkeyed rows are served in
	floorsAt  time.Time         // local time of the last fencing.AdvanceLaneFloors tried; zero: never
	shareAt   time.Time         // local time an idle pass last read the fair share (claimLanes)
	motionGap time.Duration     // an idle relay's wait between passes while its lanes change hands; 0: not in motion (lanesInMotion)
}

// floorEvery is how often a relay advances its lanes' floors
// (fencing.AdvanceLaneFloors: a candidate per lane, raised at a later
// call once no transaction that could still commit a row below it runs).
// Its first claim starts an advance at once, so a new relay (a new owner
// of the lanes) soon starts at the floors its predecessors' candidates
// allow. Each advance locks the relay's lanes and descends each lane's
// index once from its floor.
const floorEvery = 250 * time.Millisecond

// advanceFloors starts an advance of the floors of lanes when one is due
// (see floorEvery) and none is running. It runs beside the claims, which
// never wait for it: a claim reads the floors as they are, and one that
// read them just before they rose only starts lower. A failure is logged
// and changes nothing. waitFloors waits for it.
func (cl *claimer) advanceFloors(lanes []int, total int) {
	if len(lanes) == 0 || !cl.floorsBusy.CompareAndSwap(false, true) {
		return
	}
	cl.lanesMu.Lock()
	due := cl.lanes.floorsAt.IsZero() || time.Since(cl.lanes.floorsAt) >= floorEvery
	if due {
		cl.lanes.floorsAt = time.Now()
	}
	cl.lanesMu.Unlock()
	if !due {
		cl.floorsBusy.Store(false)
		return
	}
	lanes = slices.Clone(lanes)
	cl.floorsRun.Add(1)
	go func() {
		defer cl.floorsRun.Done()
		defer cl.floorsBusy.Store(false)
		ctx, cancel := context.WithTimeout(context.Background(), cl.dbTimeout)
		defer cancel()
		if _, err := fencing.AdvanceLaneFloors(ctx, cl.db, cl.cfg.Owner, lanes, total); err != nil {
			cl.logger.Error("Outbox lane floors not advanced; claims start at the floors as they are", err, nil)
		}
		if cl.draining.Load() {
			sctx, cancel := context.WithTimeout(context.Background(), cl.dbTimeout)
			defer cancel()
			cl.followShare(sctx)
		}
	}()
}

// followShare renews the lanes now, not at the next renewal (a third of
// LeaseDuration away), when the fleet changed since the last renewal (the
// fair share is not what it was: a relay joined or left) or when a lane
// over the share waits to be given back and nothing claimed there is held
// any more. It runs beside the claims, with the floors' advance (every
// floorEvery), while the relay drains full batches: an idle relay's lanes
// follow the fleet at its renewals, and its polls cost no statement more.
// It reads the share without writing (fencing.LaneShare): a renewal writes
// every lane of the relay and waits for its outcome writes, so it runs only
// when something is to be done.
//
// Without it, a relay that joined a busy fleet claimed nothing until a
// relay over its share next renewed: on a 50,000-row drain the first of
// four relays took every lane and relayed the whole backlog alone.
func (cl *claimer) followShare(ctx context.Context) {
	share, _, err := fencing.LaneShare(ctx, cl.db, cl.cfg.Owner)
	if err != nil {
		cl.logger.Error("Outbox lanes' fair share not read; the lanes follow the fleet at their next renewal", err, nil)
		return
	}
	cl.lanesMu.Lock()
	defer cl.lanesMu.Unlock()
	k := &cl.lanes
	if !k.entered || k.total == 0 {
		return
	}
	if share != k.share || len(cl.settledLocked()) > 0 {
		cl.renewLanesLocked(ctx)
	}
}

// settledLocked returns the lanes over the share that nothing claimed
// before they were marked is held in any more: those to give back (under
// lanesMu).
func (cl *claimer) settledLocked() []int {
	var back []int
	for l, since := range cl.lanes.draining {
		if !cl.heldSince(since) {
			back = append(back, l)
		}
	}
	return back
}

// lanesInMotion reports whether the relay serves lanes and its lanes are
// not yet what its fair share says (at its last renewal): it owns fewer
// (lanes are on their way to it: a relay over its share gives them back
// once it holds nothing there, or their lease runs out), or it still owns
// lanes over its share that it no longer claims in (given back once what
// it claimed there settled). Either way rows wait in lanes nobody claims
// from, so an idle relay does not back off toward MaxPollInterval: it
// waits the returned time, a tenth of PollInterval at first, doubled at
// each call up to motionMaxWait, and each pass renews the lanes first when
// they are due (claimLanes). A hand-over takes a few hundred milliseconds;
// lanes held under the lease of a relay that died come free when it runs
// out, and meanwhile the relay short of them, once its wait has grown,
// renews at most four times a second. Not while its renewals fail: it
// backs off as after any idle pass (claims stop anyway once none succeeded
// for half a lease).
func (cl *claimer) lanesInMotion() (time.Duration, bool) {
	cl.lanesMu.Lock()
	defer cl.lanesMu.Unlock()
	k := &cl.lanes
	if !k.entered || k.atShare() || k.tried.After(k.renewedAt) {
		k.motionGap = 0
		return 0, false
	}
	k.motionGap = min(cl.motionMaxWait(), max(cl.cfg.PollInterval/10, 2*k.motionGap))
	return k.motionGap, true
}

// atShare reports whether the relay's lanes are what its fair share (at its
// last renewal) says: no fewer, and none over it left to give back.
func (k *laneKeeper) atShare() bool { return len(k.owned) >= k.share && len(k.draining) == 0 }

// laneCheckEvery is how often an idle relay looks at its lanes' fleet: it
// reads the fair share at most this often (claimLanes), and while its
// lanes change hands waits at most this long between passes
// (motionMaxWait). floorEvery at least: a relay polling every few
// milliseconds would otherwise read and write as often.
func (cl *claimer) laneCheckEvery() time.Duration { return max(cl.cfg.PollInterval, floorEvery) }

// motionMaxWait is the longest wait between the passes of an idle relay
// whose lanes change hands (lanesInMotion): laneCheckEvery, but no more
// than MaxPollInterval.
func (cl *claimer) motionMaxWait() time.Duration {
	return min(cl.laneCheckEvery(), cl.cfg.MaxPollInterval)
}

// waitFloors waits for the advance of the floors in progress, if any
// (Run and RunOnce, before they return).
func (cl *claimer) waitFloors() { cl.floorsRun.Wait() }

// laneRenewEvery is how often a relay renews its lanes: a third of their
// lease, so two renewals may fail before a lane can be taken.
func (cl *claimer) laneRenewEvery() time.Duration { return cl.cfg.LeaseDuration / 3 }

// claimLanes returns the lanes a claim that started at may read now, in the
// order to serve them, and the table's lane count, renewing the lanes first
// when due. It returns no lanes when the relay owns none, or when it could
// not renew them for so long that another relay may have taken them. From
// the renewal on the claim counts as holding rows (heldSince): a lane over
// the share marked after that may be in its list. One that the renewal
// itself marked is not, so the renewal can give it back at once.
func (cl *claimer) claimLanes(ctx context.Context, at time.Time) ([]int, int, error) {
	cl.lanesMu.Lock()
	defer cl.lanesMu.Unlock()
	k := &cl.lanes
	if !k.entered {
		if err := fencing.EnterFence(ctx, cl.db, cl.cfg.Owner, fencing.FenceLanes); err != nil {
			return nil, 0, err
		}
		k.entered = true
	}
	now := time.Now()
	takeEvery := cl.cfg.PollInterval // short of the share: how often to try to take lanes
	if k.motionGap > 0 {
		takeEvery = k.motionGap // idle: as often as the loop polls (lanesInMotion)
	}
	due := now.Sub(k.renewedAt) >= cl.laneRenewEvery() || (len(k.owned) < k.share && now.Sub(k.tried) >= takeEvery) || k.total == 0 ||
		len(cl.settledLocked()) > 0
	if !due && !cl.draining.Load() && now.Sub(k.shareAt) >= cl.laneCheckEvery() {
		// Not draining full batches, so followShare does not run: read the
		// share here, as often as followShare does (floorEvery), or every
		// PollInterval when that is longer. Without it an idle relay
		// learned that a relay left (giving its lanes back) only at its
		// next renewal, and the rows written to those lanes waited for it.
		k.shareAt = now
		share, _, err := fencing.LaneShare(ctx, cl.db, cl.cfg.Owner)
		if err != nil {
			cl.logger.Error("Outbox lanes' fair share not read; the lanes follow the fleet at their next renewal", err, nil)
		}
		due = err == nil && share != k.share
	}
	if due {
		cl.renewLanesLocked(ctx)
	}
	if k.atShare() {
		k.motionGap = 0 // the hand-over ended: the next one starts from PollInterval/10 again
	}
	cl.setClaiming(at)
	if time.Since(k.renewedAt) >= cl.cfg.LeaseDuration/2 {
		return nil, k.total, nil // not renewed for half a lease: claim nothing until a renewal succeeds
	}
	lanes := make([]int, 0, len(k.owned))
	for _, l := range k.owned {
		if _, gone := k.draining[l.Lane]; !gone {
			lanes = append(lanes, l.Lane)
		}
	}
	if n := len(lanes); n > 1 {
		k.turn = (k.turn + 1) % n
		lanes = append(lanes[k.turn:], lanes[:k.turn]...)
	}
	return lanes, k.total, nil
}

// renewLanes renews the relay's lanes (the heartbeat calls it).
func (cl *claimer) renewLanes(ctx context.Context) {
	cl.lanesMu.Lock()
	defer cl.lanesMu.Unlock()
	if cl.lanes.entered {
		cl.renewLanesLocked(ctx)
	}
}

// renewLanesLocked renews the owned lanes and takes more up to the fair
// share in one statement, marks lanes over the share for giving back, and
// gives back those it holds nothing in any more.
func (cl *claimer) renewLanesLocked(ctx context.Context) {
	k := &cl.lanes
	sent := time.Now()
	k.tried = sent
	st, err := fencing.TakeLanes(ctx, cl.db, fencing.LaneParams{Owner: cl.cfg.Owner, TTL: cl.cfg.LeaseDuration, MaxAttempts: cl.cfg.MaxAttempts})
	if err != nil {
		cl.logger.Error("Outbox lanes not renewed; claims stop once they were not renewed for half a lease", err, nil)
		return
	}
	k.owned, k.share, k.total, k.renewedAt = st.Owned, st.Share, st.Total, sent
	if len(st.Taken) > 0 {
		cl.logger.Info("Outbox lanes taken", watermill.LogFields{"lanes": st.Taken, "owned": len(st.Owned), "share": st.Share})
	}
	if st.Charged > 0 {
		cl.warn("Outbox lanes taken over from a relay whose lease expired: the rows it held without an outcome were charged an attempt", watermill.LogFields{
			"charged": st.Charged, "exhausted": st.Parked,
		})
	}
	for l := range k.draining {
		if !slices.ContainsFunc(k.owned, func(o fencing.LaneLease) bool { return o.Lane == l }) {
			delete(k.draining, l)
		}
	}
	// A share that rose again (a relay left before the lanes it caused to
	// be marked were given back): they are served again, not given back
	// and taken anew.
	for l := range k.draining {
		if len(k.owned)-len(k.draining) >= k.share {
			break
		}
		delete(k.draining, l)
	}
	// Lanes over the share (other relays joined): no more claims there;
	// given back once nothing claimed before is held.
	for i := len(k.owned) - 1; i >= 0 && len(k.owned)-len(k.draining) > k.share; i-- {
		if _, ok := k.draining[k.owned[i].Lane]; !ok {
			if k.draining == nil {
				k.draining = make(map[int]time.Time)
			}
			k.draining[k.owned[i].Lane] = cl.localNow() // the clock cl.held is stamped with
		}
	}
	back := cl.settledLocked()
	if len(back) == 0 {
		return
	}
	gone, err := fencing.GiveBackLanes(ctx, cl.db, cl.cfg.Owner, back)
	if err != nil {
		cl.logger.Error("Outbox lanes over the share not given back; they are tried again at the next renewal", err, nil)
		return
	}
	for _, l := range gone {
		delete(k.draining, l)
	}
	k.owned = slices.DeleteFunc(k.owned, func(o fencing.LaneLease) bool { return slices.Contains(gone, o.Lane) })
	cl.logger.Info("Outbox lanes given back to share them with other relays", watermill.LogFields{"lanes": gone, "owned": len(k.owned), "share": k.share})
}

// giveBackLanes gives every lane back (the relay stops, after its drain).
func (cl *claimer) giveBackLanes(ctx context.Context) {
	cl.lanesMu.Lock()
	defer cl.lanesMu.Unlock()
	if !cl.lanes.entered || len(cl.lanes.owned) == 0 {
		return
	}
	if _, err := fencing.GiveBackLanes(ctx, cl.db, cl.cfg.Owner, nil); err != nil {
		cl.logger.Error("Outbox lanes not given back; other relays take them when their lease expires", err, nil)
		return
	}
	cl.lanes.owned, cl.lanes.draining = nil, nil
}

// heldSince reports whether the relay holds a row claimed at or before t,
// counting a claim in progress that started then: its statements may have
// recorded rows on the lanes already, and it records them in held only
// when they return (a lane given back in between would be given back with
// rows in flight, its record cleared, and a crash would charge them no
// attempt).
func (cl *claimer) heldSince(t time.Time) bool {
	cl.heldMu.Lock()
	defer cl.heldMu.Unlock()
	if !cl.claiming.IsZero() && !cl.claiming.After(t) {
		return true
	}
	for _, h := range cl.held {
		if !h.at.After(t) {
			return true
		}
	}
	return false
}

// setClaiming records the start of the claim in progress (zero: it ended).
func (cl *claimer) setClaiming(at time.Time) {
	cl.heldMu.Lock()
	cl.claiming = at
	cl.heldMu.Unlock()
}

// enterFence makes the relay's fence scheme the fleet's, refusing with
// FENCE_SCHEME_CONFLICT while a live relay of the other runs (Run, after
// its first heartbeat).
func (cl *claimer) enterFence(ctx context.Context) error {
	if cl.cfg.Fence == FenceRows {
		return fencing.EnterFence(ctx, cl.db, cl.cfg.Owner, fencing.FenceRows)
	}
	cl.lanesMu.Lock()
	defer cl.lanesMu.Unlock()
	if err := fencing.EnterFence(ctx, cl.db, cl.cfg.Owner, fencing.FenceLanes); err != nil {
		return err
	}
	cl.lanes.entered = true
	cl.renewLanesLocked(ctx)
	return nil
}

// beatFence is the scheme the relay's heartbeat names ("" for per-row
// leases, as relays built before lanes leave it).
func (e *env) beatFence() string {
	if e.cfg.Fence == FenceLanes {
		return fencing.FenceLanes
	}
	return ""
}
