package fencing_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
)

// A relay's outcome writes, its own lane renewals (each heartbeat) and its
// give-backs lock its lanes in one order, by lane, so they cannot
// deadlock. In the physical order of the lanes' row versions they did:
// every UPDATE of a lane moves its visible version, two statements whose
// snapshots straddle one such UPDATE read the lanes in different orders,
// and PostgreSQL broke the cycle by failing one of them (CI, 16:
// "fencing.Apply: pq: deadlock detected", the outcome write of a relay
// whose heartbeat renewed its lanes meanwhile). Here an outcome write, the
// owner's renewal and a stranger's no-op updates of single lanes (which
// move their versions) race for a fixed number of rounds each; any
// statement that fails fails the test.
func TestLaneLocksAreTakenInLaneOrder(t *testing.T) {
	s := newDB(t)
	ctx := context.Background()
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 8, 1000))
	s.DB.SetMaxOpenConns(8)
	s.DB.SetMaxIdleConns(8)
	// One row per lane: a keyed row's lane is its key's hash.
	a := takeLanes(t, s.DB, "a", time.Minute, 1000)
	require.Len(t, a.state.Owned, 8)
	for i := range 64 {
		insert(t, s.DB, fmt.Sprintf("m%02d", i), fmt.Sprintf("k%02d", i))
	}
	got := a.claim(t, s.DB, 1000)
	require.Len(t, got, 64)
	// An outcome that writes the row and leaves it claimable with the
	// attempts it had: the same lease applies every round.
	var halves [2][]fencing.Outcome
	for i, c := range got {
		halves[i%2] = append(halves[i%2], fencing.Outcome{Lease: c.Lease, To: envelope.StatusPending, Code: "BROKER_BUSY"})
	}

	const rounds = 1000
	var wg sync.WaitGroup
	var deadlocks atomic.Int64
	errs := make(chan error, 4)
	run := func(name string, f func(i int) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				if err := f(i); err != nil {
					if pgerr.Is(err, pgerr.DeadlockDetected) {
						deadlocks.Add(1)
						continue
					}
					errs <- fmt.Errorf("%s round %d: %w", name, i, err)
					return
				}
			}
		}()
	}
	// Two outcome writes at once, as a relay's concurrent passes write.
	for _, outcomes := range halves {
		run("outcome", func(int) error {
			res, err := fencing.Apply(ctx, s.DB, outcomes)
			if err == nil {
				for i, r := range res {
					if r != fencing.Applied {
						return fmt.Errorf("outcome %d: %v", i, r)
					}
				}
			}
			return err
		})
	}
	run("renewal", func(int) error {
		_, err := fencing.TakeLanes(ctx, s.DB, fencing.LaneParams{Owner: "a", TTL: time.Minute, MaxAttempts: 1000})
		return err
	})
	run("shuffle", func(i int) error {
		_, err := s.DB.Exec(`UPDATE messaging_relay_lane SET changed_at = changed_at WHERE lane = $1`, (i*5)%8)
		return err
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Zero(t, deadlocks.Load(), "statements PostgreSQL failed to break a deadlock")
}

// A claim records what its relay holds in each lane (one row per lane in
// messaging_relay_lane_held) while a takeover of those lanes, their lease
// lapsed, locks the same rows to charge what they list: both lock them in
// lane order. Each round a relay takes every lane and claims; a third
// session holding one lane's record stalls the claim in the middle of its
// record, as a slow claim would be, while another relay expires the lanes
// and takes them over; then the record is let go. Any statement that
// fails fails the test.
func TestClaimAndTakeoverLockTheHeldRecordInLaneOrder(t *testing.T) {
	s := newDB(t)
	ctx := context.Background()
	const lanes, budget = 8, 1 << 30
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, lanes, budget))
	s.DB.SetMaxOpenConns(8)
	s.DB.SetMaxIdleConns(8)
	for i := range 256 {
		insert(t, s.DB, fmt.Sprintf("m%03d", i), fmt.Sprintf("k%03d", i))
	}
	all := make([]int, lanes)
	for i := range all {
		all[i] = i
	}
	// waiting reports whether n statements wait, directly or through one
	// another, for the lock the stalling session (backend pid) holds: only
	// this test's statements, whatever else runs on the server.
	waiting := func(pid, n int) func() bool {
		return func() bool {
			var got int
			require.NoError(t, s.DB.QueryRow(`WITH RECURSIVE blocked(pid) AS (
				SELECT a.pid FROM pg_stat_activity a WHERE $1::int = ANY (pg_blocking_pids(a.pid))
				UNION
				SELECT a.pid FROM pg_stat_activity a, blocked b WHERE b.pid = ANY (pg_blocking_pids(a.pid)))
				SELECT count(*) FROM blocked`, pid).Scan(&got))
			return got >= n
		}
	}
	var deadlocks, charged int
	for round := range 12 {
		_, err := fencing.TakeLanes(ctx, s.DB, fencing.LaneParams{Owner: "a", TTL: time.Minute, MaxAttempts: budget})
		require.NoError(t, err)
		stall, err := s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = stall.Exec(`SELECT 1 FROM messaging_relay_lane_held WHERE lane = $1 FOR NO KEY UPDATE`, round%lanes)
		require.NoError(t, err)
		var pid int
		require.NoError(t, stall.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid))
		claimed := make(chan error, 1)
		go func() {
			_, err := fencing.Claim(ctx, s.DB, fencing.ClaimParams{Owner: "a", Limit: 1000, MaxAttempts: budget,
				Lanes: all, LaneCount: lanes})
			claimed <- err
		}()
		waitFor(t, waiting(pid, 1)) // the claim, on the stalled record
		_, err = s.DB.Exec(`UPDATE messaging_relay_lane SET lease_expires_at = now() - interval '1 second' WHERE owner = 'a'`)
		require.NoError(t, err)
		took := make(chan fencing.LaneState, 1)
		var takeErr error
		go func() {
			st, err := fencing.TakeLanes(ctx, s.DB, fencing.LaneParams{Owner: "b", TTL: time.Minute, MaxAttempts: budget})
			takeErr = err
			took <- st
		}()
		waitFor(t, waiting(pid, 2)) // and the takeover, on the claim or the stall
		require.NoError(t, stall.Commit())
		claimErr, st := <-claimed, <-took
		for _, err := range []error{claimErr, takeErr} {
			if pgerr.Is(err, pgerr.DeadlockDetected) {
				deadlocks++
				continue
			}
			require.NoError(t, err)
		}
		charged += st.Charged
		_, err = fencing.GiveBackLanes(ctx, s.DB, "b", nil)
		require.NoError(t, err)
	}
	require.Zero(t, deadlocks, "statements PostgreSQL failed to break a deadlock")
	require.Positive(t, charged, "the takeovers charged what the claims recorded")
}
