package main

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"time"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Claim cost per row in the lane scheme with 1 and 4 relays (issue 30: "a
// claim per row with 4 relays <= 1.2x one relay's"), part of the claimcost
// group.
//
// Each cell is a fresh schema with 32 lanes (`outboxctl lanes set 32`) and
// a backlog of LaneClaimRows unkeyed rows, CHECKPOINTed after the fill. N
// relay owners each beat a LANES heartbeat first, so that each then takes
// its fair share with fencing.TakeLanes (32/N lanes). Each owner, on its own
// connection, claims LaneClaimBatch rows of its lanes (fencing.Claim with
// Lanes, LaneCount; the lanes rotated between claims as the forwarder does)
// and writes them PUBLISHED (fencing.Apply with their lane leases), until its
// lanes are empty. The cell is the time the Claim calls took, summed over
// all owners, divided by the rows claimed: the claim statement's round trip
// as the client sees it (on one machine, the server's time plus a local
// round trip). Nothing is published; the outcomes are the only other
// statements.
//
//   - x1: one owner, all 32 lanes.
//   - x4: four owners, 8 lanes each, claiming concurrently.
//   - x4-serial: the same four owners, one claim-and-outcome at a time
//     (evidence: what the claim costs on a quarter of the lanes without
//     four backends competing for the machine's cores).
func laneClaimName(relays int) string { return fmt.Sprintf("claimcost/lanes/x%d", relays) }

func laneClaimSerialName(relays int) string { return laneClaimName(relays) + "-serial" }

// laneClaimCells are the cells in run order for repetition rep: x1 and x4
// swap places every other repetition, so neither always runs first.
type laneClaimCase struct {
	relays int
	serial bool
}

func (l laneClaimCase) name() string {
	if l.serial {
		return laneClaimSerialName(l.relays)
	}
	return laneClaimName(l.relays)
}

func laneClaimCases(rep int) []laneClaimCase {
	cs := []laneClaimCase{{1, false}, {4, false}, {4, true}}
	if rep%2 == 0 {
		cs[0], cs[1] = cs[1], cs[0]
	}
	return cs
}

const (
	probeLanes   = 32
	probeLaneTTL = 10 * time.Minute
)

func runLaneClaimCost(ctx context.Context, e *env, cfg Config, c *collector, rep int, payload []byte, logf func(string, ...any)) error {
	for _, lc := range laneClaimCases(rep) {
		us, claims, err := laneClaimCell(ctx, e, cfg.LaneClaimRows, cfg.LaneClaimBatch, lc.relays, lc.serial, payload)
		if err != nil {
			return fmt.Errorf("%s: %w", lc.name(), err)
		}
		c.add("claimcost", lc.name(), "µs/row", us)
		logf("  %-28s %8.2f µs per claimed row (%d claims)", lc.name(), us, claims)
	}
	return nil
}

// laneClaimCell drains a rows-row backlog with relays lane owners as
// described above and returns the claim statements' time per claimed row,
// in µs, and the number of claims that returned rows.
func laneClaimCell(ctx context.Context, e *env, rows, batch, relays int, serial bool, payload []byte) (float64, int, error) {
	if relays < 1 || probeLanes%relays != 0 {
		return 0, 0, fmt.Errorf("%d relays do not share %d lanes evenly", relays, probeLanes)
	}
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return 0, 0, err
	}
	defer s.drop()
	if err := fencing.SetLaneCount(ctx, s.db, probeLanes, forwarder.DefaultMaxAttempts); err != nil {
		return 0, 0, err
	}
	if err := prefill(ctx, s.db, prefillOutbox, "ob-", rows, payload); err != nil {
		return 0, 0, err
	}
	total, err := fencing.LaneCount(ctx, s.db)
	if err != nil {
		return 0, 0, err
	}
	type owner struct {
		name  string
		db    *sql.DB
		lanes []int
	}
	owners := make([]*owner, relays)
	defer func() {
		for _, o := range owners {
			if o != nil {
				_ = o.db.Close()
			}
		}
	}()
	for i := range owners {
		db, err := s.open(1)
		if err != nil {
			return 0, 0, err
		}
		owners[i] = &owner{name: fmt.Sprintf("lane-probe-%d", i), db: db}
		// Every heartbeat first: each owner's share is then 32/relays.
		if err := relaymode.BeatFence(ctx, db, owners[i].name, probeLaneTTL, forwarder.DefaultMaxAttempts, fencing.FenceLanes); err != nil {
			return 0, 0, err
		}
	}
	for _, o := range owners {
		if err := fencing.EnterFence(ctx, o.db, o.name, fencing.FenceLanes); err != nil {
			return 0, 0, err
		}
		st, err := fencing.TakeLanes(ctx, o.db, fencing.LaneParams{Owner: o.name, TTL: probeLaneTTL, MaxAttempts: forwarder.DefaultMaxAttempts})
		if err != nil {
			return 0, 0, err
		}
		if len(st.Owned) != probeLanes/relays {
			return 0, 0, fmt.Errorf("owner %s took %d lanes, want %d", o.name, len(st.Owned), probeLanes/relays)
		}
		for _, l := range st.Owned {
			o.lanes = append(o.lanes, l.Lane)
		}
	}
	settle(ctx, s.db)

	var (
		mu      sync.Mutex // serial: one claim and its outcome at a time
		sumMu   sync.Mutex
		spent   time.Duration
		claimed int
		claims  int
		wg      sync.WaitGroup
		errs    = make([]error, relays)
	)
	for i, o := range owners {
		wg.Go(func() {
			var own time.Duration
			var n, k int
			defer func() {
				sumMu.Lock()
				spent, claimed, claims = spent+own, claimed+n, claims+k
				sumMu.Unlock()
			}()
			p := probeParams()
			p.Owner, p.Limit, p.MaxChain, p.LaneCount = o.name, batch, 0, total
			for turn := 0; ; turn++ {
				if ctx.Err() != nil {
					errs[i] = ctx.Err()
					return
				}
				t := turn % len(o.lanes)
				p.Lanes = append(append([]int(nil), o.lanes[t:]...), o.lanes[:t]...)
				if serial {
					mu.Lock()
				}
				start := time.Now()
				got, err := fencing.Claim(ctx, o.db, p)
				d := time.Since(start)
				if err == nil && len(got) > 0 {
					var res []fencing.Result
					if res, err = fencing.Apply(ctx, o.db, publishedOutcomes(got)); err == nil {
						for j, r := range res {
							if r != fencing.Applied {
								err = fmt.Errorf("outcome of %s: %s", got[j].Row.MessageID, r)
								break
							}
						}
					}
				}
				if serial {
					mu.Unlock()
				}
				if err != nil {
					errs[i] = err
					return
				}
				if len(got) == 0 {
					return
				}
				own += d
				n += len(got)
				k++
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return 0, 0, err
		}
	}
	if claimed != rows {
		return 0, 0, fmt.Errorf("%d rows claimed, want %d", claimed, rows)
	}
	return float64(spent.Microseconds()) / float64(claimed), claims, nil
}
