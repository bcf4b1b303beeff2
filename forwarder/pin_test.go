package forwarder_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
)

// backends records the PostgreSQL backend each claim and outcome statement
// of a relay ran on (asked on the same connection just before it), in order.
type backends struct {
	mu               sync.Mutex
	claims, outcomes []int
}

func (b *backends) wrap(q fencing.DBTX) fencing.DBTX { return &onBackend{DBTX: q, b: b} }

func (b *backends) seen() (claims, outcomes []int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.claims), slices.Clone(b.outcomes)
}

type onBackend struct {
	fencing.DBTX
	b *backends
}

func (d *onBackend) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	claim, outcome := isClaim(q) || strings.Contains(q, "parked AS (") && strings.Contains(q, "messaging_relay_lane_held"), isOutcome(q)
	if claim || outcome {
		var pid int
		if err := d.DBTX.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err == nil {
			d.b.mu.Lock()
			if claim {
				d.b.claims = append(d.b.claims, pid)
			} else {
				d.b.outcomes = append(d.b.outcomes, pid)
			}
			d.b.mu.Unlock()
		}
	}
	return d.DBTX.QueryContext(ctx, q, args...)
}

// pinnedOn is the backend every statement of pids ran on after the first
// pass's (which runs before the relay knows it is draining full batches,
// so its connection goes back to the pool), or 0 when they ran on several.
func pinnedOn(pids []int) int {
	rest := pids
	for len(rest) > 0 && rest[0] == pids[0] {
		rest = rest[1:]
	}
	if len(rest) == 0 {
		return pids[0]
	}
	for _, p := range rest {
		if p != rest[0] {
			return 0
		}
	}
	return rest[0]
}

// A relay keeps its claims on one connection of its pool and its outcome
// writes on another (forwarder/pin.go): with a pool of 6 and the next batch
// claimed while the last one's outcomes are written, every claim ran on one
// backend and the outcomes on one other. With ShareConnection they take
// turns on one backend (the wait for the other statement unbounded here,
// so that a slow statement on a busy machine cannot send one to the pool).
// When the server ends those backends mid-drain (pg_terminate_backend, as a
// failover or an idle timeout of a proxy does), the relay goes on with new
// connections: every row is published, none is left in flight.
func TestTheRelaysClaimsAndOutcomesKeepToTheirConnections(t *testing.T) {
	for _, fence := range []forwarder.Fence{forwarder.FenceRows, forwarder.FenceLanes} {
		for _, share := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/share=%t", fence, share), func(t *testing.T) {
				relayKeepsToItsConnections(t, fence, share)
			})
		}
	}
}

func relayKeepsToItsConnections(t *testing.T, fence forwarder.Fence, share bool) {
	ctx := context.Background()
	s := newDB(t)
	if fence == forwarder.FenceLanes {
		require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 8, 25))
	}
	const n = 600
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("m%04d", i)
	}
	insertN(t, s.DB, "orders", ids...)

	var b backends
	var published atomic.Int32
	killed := make(chan []int, 1)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		if published.Add(1) == n/2 {
			claims, outcomes := b.seen()
			pids := []int{pinnedOn(claims), pinnedOn(outcomes)}
			for _, pid := range slices.Compact(slices.Clone(pids)) {
				if pid != 0 {
					_, err := s.DB.Exec(`SELECT pg_terminate_backend($1)`, pid)
					require.NoError(t, err)
				}
			}
			killed <- pids
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		Owner: "pinned", Fence: fence, BatchSize: 25, MaxBatchSize: 25, ShareConnection: share,
		PollInterval: 5 * time.Millisecond, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond,
	})
	forwarder.WrapStatements(f, b.wrap)
	if share {
		forwarder.SetPinShareWait(f, time.Hour)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()

	pids := waitOrFail(t, killed, "half the rows published")
	require.NotZero(t, pids[0], "every claim after the first pass on one backend")
	require.NotZero(t, pids[1], "every outcome write after the first pass on one backend")
	if share {
		require.Equal(t, pids[0], pids[1], "ShareConnection: claims and outcomes on the same backend")
	} else {
		require.NotEqual(t, pids[0], pids[1], "claims and outcomes on backends of their own")
	}

	await.Until(t, func() bool { return s.Count(t, "status = 'PUBLISHED'") == n }, "every row published after the kill")
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"))
	claims, _ := b.seen()
	require.NotEqual(t, pids[0], claims[len(claims)-1], "the claims went on on a new backend")
}

// RunOnce and Run leave no connection of the pool pinned when they return,
// though their claims came back full.
func TestARelayThatReturnedHoldsNoConnection(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	ids := make([]string, 30)
	for i := range ids {
		ids[i] = fmt.Sprintf("m%02d", i)
	}
	insertN(t, s.DB, "orders", ids...)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "once", BatchSize: 10, MaxBatchSize: 10, PollInterval: 5 * time.Millisecond})
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 10, rep.Published, "a full batch: the relay drains")
	require.Zero(t, s.DB.Stats().InUse, "RunOnce returned: nothing pinned")

	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Run(rctx) }()
	await.Until(t, func() bool { return len(rec.ids()) == 30 }, "30 deliveries")
	cancel()
	require.NoError(t, waitOrFail(t, done, "Run returning"))
	require.Zero(t, s.DB.Stats().InUse, "Run returned: nothing pinned")
}
