package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strconv"
	"strings"
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
// Warm connections: each owner's first LaneClaimWarm claims are not timed
// (their rows are claimed as the others are). A new backend's first
// statements pay once what a relay that runs for hours pays once too: its
// catalog caches, the five custom plans PostgreSQL makes of each prepared
// statement before it considers the generic one (the walk over keys is
// 20 KB of SQL, 4-5 ms to plan), and the first touch of every shared buffer
// it maps. Four owners pay it four times over a quarter of the rows each,
// which on a short backlog made the cell measure connection start-up
// (BENCHMARKS.md, session 8). <cell>/cold counts every claim, for
// comparison.
//
// Beside each, <cell>/cpu: the CPU time the owners' server backends ran
// during their Claim calls (/proc/<backend pid>/schedstat, read before and
// after each call: nanoseconds on a CPU, time waiting for one left out), per
// claimed row. It needs the server on this machine; elsewhere it is 0. On a
// machine with fewer cores than relays the wall time of x4 includes waiting
// for a core; the CPU time does not.
//
//   - x1: one owner, all 32 lanes.
//   - x2: two owners, 16 lanes each, claiming concurrently (evidence: as
//     many relays as this benchmark machine has cores).
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
	cs := []laneClaimCase{{1, false}, {4, false}, {2, false}, {4, true}}
	if rep%2 == 0 {
		cs[0], cs[1] = cs[1], cs[0]
	}
	return cs
}

const (
	// As the forwarder runs its claims on a backlog without ordering keys:
	// it walks the keys on every walkEvery-th claim only (forwarder's
	// walkEvery: the others run the unkeyed claim), and advances its lanes'
	// floors every floorEvery (forwarder's floorEvery). Without the floors
	// every claim descended each lane from its first entry, over the dead
	// entries of every row published there (no VACUUM runs meanwhile), and
	// a claim cost more the longer the cell ran.
	walkEvery    = 8
	floorEvery   = 250 * time.Millisecond
	probeLanes   = 32
	probeLaneTTL = 10 * time.Minute
	// DefaultLaneClaimWarm is how many claims of each owner warm its
	// connection up (not timed; -lane-claim-warm): six walks over keys, so
	// that every statement the owner runs has been planned five times and
	// had its generic plan weighed.
	DefaultLaneClaimWarm = 6 * walkEvery
)

func runLaneClaimCost(ctx context.Context, e *env, cfg Config, c *collector, rep int, payload []byte, logf func(string, ...any)) error {
	for _, lc := range laneClaimCases(rep) {
		res, err := laneClaimCell(ctx, e, cfg.LaneClaimRows, cfg.LaneClaimBatch, cfg.LaneClaimWarm, lc.relays, lc.serial, payload)
		if err != nil {
			return fmt.Errorf("%s: %w", lc.name(), err)
		}
		c.add("claimcost", lc.name(), "µs/row", res.wallUS)
		c.add("claimcost", lc.name()+"/cpu", "µs/row", res.cpuUS)
		c.add("claimcost", lc.name()+"/cold", "µs/row", res.cold.wallUS)
		c.add("claimcost", lc.name()+"/cold/cpu", "µs/row", res.cold.cpuUS)
		logf("  %-28s %8.2f µs per claimed row, server backend CPU %.2f µs (%d claims after %d to warm up each connection; counting those: %.2f and %.2f µs)",
			lc.name(), res.wallUS, res.cpuUS, res.claims, cfg.LaneClaimWarm, res.cold.wallUS, res.cold.cpuUS)
	}
	return nil
}

// laneClaim is one lane claim cell's result: µs per claimed row of the
// timed Claim calls (wall) and of their backends' CPU, and the timed claims
// that returned rows; cold counts every claim, the warm-up's too.
type laneClaim struct {
	wallUS, cpuUS float64
	claims        int
	cold          struct{ wallUS, cpuUS float64 }
}

// claimTally sums Claim calls: their wall time, their backends' CPU, the
// rows they claimed and how many they were.
type claimTally struct {
	wall, cpu    time.Duration
	rows, claims int
}

func (t *claimTally) add(o claimTally) {
	t.wall, t.cpu, t.rows, t.claims = t.wall+o.wall, t.cpu+o.cpu, t.rows+o.rows, t.claims+o.claims
}

// perRow returns the tally's wall and CPU time per claimed row in µs (CPU
// 0 when noCPU).
func (t claimTally) perRow(noCPU bool) (wallUS, cpuUS float64) {
	if t.rows == 0 {
		return 0, 0
	}
	wallUS = float64(t.wall.Microseconds()) / float64(t.rows)
	if !noCPU {
		cpuUS = float64(t.cpu.Microseconds()) / float64(t.rows)
	}
	return wallUS, cpuUS
}

// backendCPU is the CPU time a server process has run, from
// /proc/<pid>/schedstat (its first field, nanoseconds).
func backendCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/schedstat")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, fmt.Errorf("empty schedstat of %d", pid)
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	return time.Duration(ns), err
}

// laneClaimCell drains a rows-row backlog with relays lane owners as
// described above, timing each owner's claims after its first warm.
func laneClaimCell(ctx context.Context, e *env, rows, batch, warm, relays int, serial bool, payload []byte) (laneClaim, error) {
	if relays < 1 || probeLanes%relays != 0 {
		return laneClaim{}, fmt.Errorf("%d relays do not share %d lanes evenly", relays, probeLanes)
	}
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return laneClaim{}, err
	}
	defer s.drop()
	if err := fencing.SetLaneCount(ctx, s.db, probeLanes, forwarder.DefaultMaxAttempts); err != nil {
		return laneClaim{}, err
	}
	if err := prefill(ctx, s.db, prefillOutbox, "ob-", rows, payload); err != nil {
		return laneClaim{}, err
	}
	total, err := fencing.LaneCount(ctx, s.db)
	if err != nil {
		return laneClaim{}, err
	}
	type owner struct {
		name  string
		db    *sql.DB           // one connection: the same backend throughout
		q     *fencing.Prepared // the claim and outcome statements prepared on db, as the forwarder runs them
		pid   int               // its backend; 0 when its CPU cannot be read here
		lanes []int
	}
	owners := make([]*owner, relays)
	defer func() {
		for _, o := range owners {
			if o != nil {
				_ = o.q.Close()
				_ = o.db.Close()
			}
		}
	}()
	for i := range owners {
		db, err := s.open(1)
		if err != nil {
			return laneClaim{}, err
		}
		owners[i] = &owner{name: fmt.Sprintf("lane-probe-%d", i), db: db, q: fencing.NewPrepared(db)}
		if err := db.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&owners[i].pid); err != nil {
			return laneClaim{}, err
		}
		if _, err := backendCPU(owners[i].pid); err != nil {
			owners[i].pid = 0 // the server is not on this machine
		}
		// Every heartbeat first: each owner's share is then 32/relays.
		if err := relaymode.BeatFence(ctx, db, owners[i].name, probeLaneTTL, forwarder.DefaultMaxAttempts, fencing.FenceLanes); err != nil {
			return laneClaim{}, err
		}
	}
	for _, o := range owners {
		if err := fencing.EnterFence(ctx, o.db, o.name, fencing.FenceLanes); err != nil {
			return laneClaim{}, err
		}
		st, err := fencing.TakeLanes(ctx, o.db, fencing.LaneParams{Owner: o.name, TTL: probeLaneTTL, MaxAttempts: forwarder.DefaultMaxAttempts})
		if err != nil {
			return laneClaim{}, err
		}
		if len(st.Owned) != probeLanes/relays {
			return laneClaim{}, fmt.Errorf("owner %s took %d lanes, want %d", o.name, len(st.Owned), probeLanes/relays)
		}
		for _, l := range st.Owned {
			o.lanes = append(o.lanes, l.Lane)
		}
	}
	settle(ctx, s.db)

	var (
		mu          sync.Mutex // serial: one claim and its outcome at a time
		sumMu       sync.Mutex
		timed, cold claimTally
		noCPU       bool
		unwarmed    bool // an owner's lanes ran out before its warm-up ended
		wg          sync.WaitGroup
		errs        = make([]error, relays)
	)
	for i, o := range owners {
		wg.Go(func() {
			var own, all claimTally
			defer func() {
				sumMu.Lock()
				timed.add(own)
				cold.add(all)
				noCPU = noCPU || o.pid == 0
				unwarmed = unwarmed || (warm > 0 && own.claims == 0)
				sumMu.Unlock()
			}()
			var cpu0, cpu1 time.Duration
			var floorsAt time.Time
			p := probeParams()
			p.Owner, p.Limit, p.MaxChain, p.LaneCount = o.name, batch, 0, total
			for turn := 0; ; turn++ {
				if ctx.Err() != nil {
					errs[i] = ctx.Err()
					return
				}
				t := turn % len(o.lanes)
				p.NoKeyWalk = turn%walkEvery != 0
				p.Lanes = append(append([]int(nil), o.lanes[t:]...), o.lanes[:t]...)
				if serial {
					mu.Lock()
				}
				if o.pid != 0 {
					cpu0, _ = backendCPU(o.pid)
				}
				start := time.Now()
				got, err := fencing.Claim(ctx, o.q, p)
				d := time.Since(start)
				if o.pid != 0 {
					cpu1, _ = backendCPU(o.pid)
				}
				if err == nil && len(got) > 0 {
					var res []fencing.Result
					if res, err = fencing.Apply(ctx, o.q, publishedOutcomes(got)); err == nil {
						for j, r := range res {
							if r != fencing.Applied {
								err = fmt.Errorf("outcome of %s: %s", got[j].Row.MessageID, r)
								break
							}
						}
					}
				}
				if err == nil && time.Since(floorsAt) >= floorEvery {
					floorsAt = time.Now()
					_, err = fencing.AdvanceLaneFloors(ctx, o.db, o.name, o.lanes, total)
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
				one := claimTally{wall: d, cpu: cpu1 - cpu0, rows: len(got), claims: 1}
				all.add(one)
				if all.claims > warm {
					own.add(one)
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return laneClaim{}, err
		}
	}
	if cold.rows != rows {
		return laneClaim{}, fmt.Errorf("%d rows claimed, want %d", cold.rows, rows)
	}
	if unwarmed {
		return laneClaim{}, fmt.Errorf("%d rows in claims of %d leave an owner of %d no claim after its %d to warm up: raise -lane-claim-rows", rows, batch, relays, warm)
	}
	res := laneClaim{claims: timed.claims}
	res.wallUS, res.cpuUS = timed.perRow(noCPU)
	res.cold.wallUS, res.cold.cpuUS = cold.perRow(noCPU)
	return res, nil
}
