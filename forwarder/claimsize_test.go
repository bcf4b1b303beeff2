package forwarder_test

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// claimSizes runs passes with RunOnce until one claims nothing and returns
// how many rows each pass claimed, the empty one included.
func claimSizes(t *testing.T, f *forwarder.Forwarder) []int {
	t.Helper()
	var sizes []int
	for {
		rep, err := f.RunOnce(context.Background())
		require.NoError(t, err)
		sizes = append(sizes, rep.Claimed)
		if rep.Claimed == 0 {
			return sizes
		}
		require.Less(t, len(sizes), 100, "the backlog must drain: %v", sizes)
	}
}

// At the defaults a relay behind a backlog doubles its claims from
// BatchSize (100) to MaxBatchSize (1000) while they come back full, and
// halves them again once they come back short.
func TestClaimsGrowWhileBehindAndShrinkOnceCaughtUp(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'a' || g, 'orders', 'x' FROM generate_series(1, 3100) g`)
	require.NoError(t, err)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{})
	require.Equal(t, []int{100, 200, 400, 800, 1000, 600, 0}, claimSizes(t, f))
	require.Len(t, rec.ids(), 3100)

	// Caught up: the empty claim halved the size to 500.
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'b' || g, 'orders', 'x' FROM generate_series(1, 2000) g`)
	require.NoError(t, err)
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 500, rep.Claimed)
}

// A BatchSize set without MaxBatchSize stays fixed; with MaxBatchSize the
// claims grow from BatchSize up to it, never past it.
func TestAnExplicitBatchSizeIsFixedUnlessMaxBatchSizeIsSet(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  forwarder.Config
		want []int
	}{
		{"fixed", forwarder.Config{BatchSize: 50}, []int{50, 50, 50, 50, 50, 50, 0}},
		{"bounded", forwarder.Config{BatchSize: 10, MaxBatchSize: 40}, []int{10, 20, 40, 40, 40, 40, 40, 40, 30, 0}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newDB(t)
			_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
				SELECT 'a' || g, 'orders', 'x' FROM generate_series(1, 300) g`)
			require.NoError(t, err)
			rec := &recorder{}
			f := newForwarder(t, s.DB, rec, c.cfg)
			require.Equal(t, c.want, claimSizes(t, f))
			require.Len(t, rec.ids(), 300)
		})
	}
}

// A claim grows only while the last pass's pace says the larger batch is
// published within a quarter of its lease: against a downstream that takes
// at least 10 ms per message, one at a time, with a 2 s lease, no claim
// takes more than 500 ms / 10 ms = 50 rows, however far behind the relay is.
func TestClaimsDoNotOutgrowWhatTheLeaseCanPublish(t *testing.T) {
	t.Parallel() // waits on its downstream's pace or on leases: overlaps the other parallel tests
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'a' || g, 'orders', 'x' FROM generate_series(1, 400) g`)
	require.NoError(t, err)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		time.Sleep(10 * time.Millisecond) // the downstream's own pace, not a wait for an event
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 10, MaxBatchSize: 1000, Concurrency: 1, LeaseDuration: 2 * time.Second, PublishTimeout: time.Second,
	})
	sizes := claimSizes(t, f)
	require.Equal(t, 10, sizes[0])
	require.LessOrEqual(t, slices.Max(sizes), 50, "claims %v", sizes)
	require.Len(t, rec.ids(), 400)
}

// One key's chain is published one message at a time, so its length per
// claim follows the slowest destination lately rather than the batch:
// behind an instant downstream a single hot key is claimed in chains as
// long as the claim (here up to MaxBatchSize 400, with BatchSize 20), not
// BatchSize rows a pass; the key still goes out in seq order.
func TestAHotKeyOnAFastDestinationIsClaimedInLongChains(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'h' || lpad(g::text, 5, '0'), 'orders', 'x', 'hot' FROM generate_series(1, 2000) g`)
	require.NoError(t, err)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{BatchSize: 20, MaxBatchSize: 400})
	sizes := claimSizes(t, f)
	require.Equal(t, 400, slices.Max(sizes), "claims of one key grow past BatchSize: %v", sizes)
	got := rec.ids()
	require.Len(t, got, 2000)
	require.True(t, slices.IsSorted(got), "one key goes out in seq order")
}

// With prefetch (Run's default) the claim made ahead starts right after the
// first claim, before any publish has returned, so nextSize still sees no
// measured pace (zero) and doubles again: Run claims 10, 20, then 40 rows
// against a downstream whose pace (20 ms a message, one at a time) lets a
// 2 s lease publish 500 ms / 20 ms = 25 of them, i.e. claims of at most 20
// (RunOnce keeps to it: TestClaimsDoNotOutgrowWhatTheLeaseCanPublish). The
// 40-row claim waits for the 20 ahead of it and most of it is released
// without an attempt once its start-by deadline passes.
func TestRunClaimsAheadDoNotGrowBeforeAnyPublishWasTimed(t *testing.T) {
	t.Parallel() // waits on its downstream's pace or on leases: overlaps the other parallel tests
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'a' || g, 'orders', 'x' FROM generate_series(1, 300) g`)
	require.NoError(t, err)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		time.Sleep(20 * time.Millisecond) // the downstream's own pace, not a wait for an event
		return true, nil
	}}
	var maxClaimed, released atomic.Int64
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 10, MaxBatchSize: 1000, Concurrency: 1, LeaseDuration: 2 * time.Second, PublishTimeout: time.Second,
		OnReport: func(r forwarder.Report) {
			for {
				m := maxClaimed.Load()
				if int64(r.Claimed) <= m || maxClaimed.CompareAndSwap(m, int64(r.Claimed)) {
					break
				}
			}
			released.Add(int64(r.Released))
		},
	})
	runUntilDelivered(t, f, rec, 300)
	require.LessOrEqual(t, maxClaimed.Load(), int64(20),
		"a claim of %d rows, more than the lease can publish at the downstream's pace (%d rows released without an attempt)", maxClaimed.Load(), released.Load())
}

// A claim may grow while pace x size fits in a quarter of the lease, but no
// publish starts after the start-by deadline, LeaseDuration - 1.5 x
// PublishTimeout after the claim, which is only a quarter of the lease at
// the shortest lease Validate allows (2 x PublishTimeout); and with
// prefetch a batch claimed ahead first waits for the whole batch before it.
// Against a downstream taking at least 10 ms a message (one at a time, a 2 s
// lease, a 1 s PublishTimeout: start by 500 ms) a relay grew its claims
// from 5 to 40 rows (40 x 10 ms = 400 ms fits the quarter, 500 ms); each
// then waits about 400 ms for the one ahead, and part of every claim is
// released without an attempt, pass after pass: the growth makes the relay
// slower and churns leases. Twice a claim must fit the start-by window:
// 500 ms / (2 x 10 ms) = 25 rows at most (a slower machine only makes the
// pace slower and the claims smaller).
func TestClaimsDoNotGrowPastWhatTheStartByDeadlineLetsStart(t *testing.T) {
	t.Parallel() // waits on its downstream's pace or on leases: overlaps the other parallel tests
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'a' || g, 'orders', 'x' FROM generate_series(1, 400) g`)
	require.NoError(t, err)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		time.Sleep(10 * time.Millisecond) // the downstream's own pace, not a wait for an event
		return true, nil
	}}
	var released, maxClaimed atomic.Int64
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 5, MaxBatchSize: 1000, Concurrency: 1, LeaseDuration: 2 * time.Second, PublishTimeout: time.Second,
		OnReport: func(r forwarder.Report) {
			for {
				m := maxClaimed.Load()
				if int64(r.Claimed) <= m || maxClaimed.CompareAndSwap(m, int64(r.Claimed)) {
					break
				}
			}
			released.Add(int64(r.Released))
		},
	})
	runUntilDelivered(t, f, rec, 400)
	require.LessOrEqual(t, maxClaimed.Load(), int64(25), "a claim of %d rows: twice that at 10 ms a message overruns the 500 ms start-by window (%d rows released without an attempt)",
		maxClaimed.Load(), released.Load())
}

// The claim size follows the mean publish time over every destination, and
// a claim of size n holds at most n / Concurrency rows of one key while
// other rows fill it; but once they run out, a claim extends a key's chain
// to fill the whole batch. Behind many fast rows (an instant downstream)
// and one hot key on a slow one (10 ms a message), the mean says claims of
// a hundred rows and more fit the lease; when the fast rows run out the hot
// key's chain is extended to the whole claim and published one message at
// a time, at 10 ms, not at the mean: far past the start-by deadline (2.5 s
// after the claim: a 4 s lease, a 1 s PublishTimeout; a 1,000-row chain
// takes 10 s), so most of it is released without an attempt, claim after
// claim. A chain sized by the slow destination's own pace (a second's
// worth: 100 rows) fits. (The lease leaves the 1,000 fast rows of a batch
// seconds to spare on a loaded machine under -race.)
func TestAHotKeyOnASlowDestinationIsNotClaimedAtTheMeanPace(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'f' || g, 'fast', 'x' FROM generate_series(1, 3000) g`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'h' || g, 'slow', 'x', 'hot' FROM generate_series(1, 300) g`)
	require.NoError(t, err)
	rec := &recorder{behave: func(topic string, _ *message.Message) (bool, error) {
		if topic == "slow" {
			time.Sleep(10 * time.Millisecond) // the downstream's own pace, not a wait for an event
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 8, MaxBatchSize: 1000, Concurrency: 8, LeaseDuration: 4 * time.Second, PublishTimeout: time.Second,
	})
	var released, claims int
	for range 1000 {
		rep, err := f.RunOnce(context.Background())
		require.NoError(t, err)
		released += rep.Released
		claims++
		if rep.Claimed == 0 {
			break
		}
	}
	require.Len(t, rec.ids(), 3300)
	require.Zero(t, released, "%d rows released without an attempt over %d claims: a hot key's chain outgrew the start-by deadline", released, claims)
}
