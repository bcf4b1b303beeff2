package forwarder_test

import (
	"context"
	"slices"
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
