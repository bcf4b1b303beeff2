package forwarder

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Lanes marked over the share are given back at the relay's next pass once
// what it claimed there settled, busy or idle. Before, an idle relay gave
// them back only at its next renewal (HeartbeatInterval, 10 s by default):
// it no longer claims in a marked lane, so the lane's rows waited for that
// renewal (four relays on a 50,000-row backlog: 5,744 rows for 10 s). While
// lanes are marked, or the relay owns fewer than its share, the loop does
// not back off toward MaxPollInterval: it polls at a tenth of PollInterval,
// doubling up to motionMaxWait (lanesInMotion). The renewals are
// driven by hand and the fleet is heartbeats written by the test, so every
// step is an event.
func TestMarkedLanesAreGivenBackAtTheNextPass(t *testing.T) {
	ctx := context.Background()
	s := laneSchema(t, 8)
	f := laneRelay(t, s, "a")
	cl := f.claimer
	moving := func(c *claimer) bool {
		t.Helper()
		_, m := c.lanesInMotion()
		return m
	}
	owned := func(owner string) int { return lanesOwned(t, s, owner) }
	require.Equal(t, 8, owned("a"), "alone: every lane")
	require.False(t, moving(cl), "alone, at its share: nothing to hand over")

	row := fencing.Claimed{Row: envelope.Row{MessageID: "m", Seq: 1, Status: envelope.StatusInFlight}}
	cl.hold([]fencing.Claimed{row}, cl.localNow())
	require.NoError(t, relaymode.BeatFence(ctx, s.DB, "b", time.Hour, 25, fencing.FenceLanes))
	cl.renewLanes(ctx) // the share fell to 4: four lanes marked, kept while the row is held
	require.Equal(t, 8, owned("a"), "a row is held: nothing given back yet")
	require.True(t, moving(cl), "lanes marked over the share: the loop does not back off")
	// Each idle pass in motion waits twice as long as the last, from a
	// tenth of PollInterval up to motionMaxWait (PollInterval here).
	var gaps []time.Duration
	for range 6 {
		gap, _ := cl.lanesInMotion()
		gaps = append(gaps, gap)
	}
	p := f.cfg.PollInterval
	require.Equal(t, []time.Duration{p / 5, 2 * p / 5, 4 * p / 5, p, p, p}, gaps, "after the first wait of %s", p/10)

	// The row settles; the relay is idle. Its next pass, however soon,
	// gives the marked lanes back: the renewal is an hour away.
	cl.unhold([]fencing.Outcome{{Lease: fencing.Lease{MessageID: "m"}}})
	lanes, total, err := cl.claimLanes(ctx, cl.localNow())
	require.NoError(t, err)
	cl.setClaiming(time.Time{})
	require.Equal(t, 8, total)
	require.Len(t, lanes, 4, "the pass claims in the lanes of its share")
	require.Equal(t, 4, owned("a"), "the marked lanes were given back at the pass")
	require.False(t, moving(cl), "at its share again: the loop may back off")

	// A relay short of its share is in motion too: b, which takes the four
	// lanes a gave back at its first renewal, and polls until it has them.
	_, err = s.DB.Exec(`UPDATE messaging_relay_lane SET owner = 'c', lease_expires_at = now() + interval '1 hour' WHERE owner IS NULL`)
	require.NoError(t, err)
	g := laneRelay(t, s, "b")
	require.Zero(t, owned("b"), "the free lanes were taken by another owner first")
	require.True(t, moving(g.claimer), "short of its share: the loop does not back off")
}

// While its renewals fail a relay is not in motion: it backs off as after
// any idle pass instead of polling its failing statements every few
// hundred milliseconds (its claims stop anyway once no renewal succeeded
// for half a lease).
func TestARelayWhoseRenewalsFailBacksOff(t *testing.T) {
	ctx := context.Background()
	s := laneSchema(t, 8)
	cl := laneRelay(t, s, "b").claimer
	_, err := s.DB.Exec(`UPDATE messaging_relay_lane SET owner = 'c', lease_expires_at = now() + interval '1 hour'`)
	require.NoError(t, err)
	cl.renewLanes(ctx) // c took every lane: b owns none of its share
	_, moving := cl.lanesInMotion()
	require.True(t, moving, "short of its share (c holds every lane under a live lease)")

	_, err = s.DB.Exec(`ALTER TABLE messaging_relay_lane RENAME TO messaging_relay_lane_gone`)
	require.NoError(t, err)
	cl.renewLanes(ctx)
	_, moving = cl.lanesInMotion()
	require.False(t, moving, "its renewal failed: the loop backs off")
	_, err = s.DB.Exec(`ALTER TABLE messaging_relay_lane_gone RENAME TO messaging_relay_lane`)
	require.NoError(t, err)
	cl.renewLanes(ctx)
	_, moving = cl.lanesInMotion()
	require.True(t, moving, "renewed again, still short")
}

// A relay whose share fell to no lane at all claims nothing, so no claim
// forgets the rows it held for more than a lease (an outcome write that
// failed): before, such a row stayed held for ever, the lanes it had
// marked never settled, and the relay kept every one of them (renewed by
// its heartbeat) while the relays with a share had none. Its passes now
// forget those rows, and the next one gives the lanes back.
func TestARelayWithNoShareForgetsRowsHeldPastALease(t *testing.T) {
	ctx := context.Background()
	s := laneSchema(t, 2)
	cl := laneRelay(t, s, "c").claimer
	lease := cl.cfg.LeaseDuration
	owned := func(owner string) int { return lanesOwned(t, s, owner) }
	require.Equal(t, 2, owned("c"), "alone: both lanes")

	// A row claimed more than a lease ago whose outcome was never written.
	row := fencing.Claimed{Row: envelope.Row{MessageID: "m", Seq: 1, Status: envelope.StatusInFlight}}
	cl.hold([]fencing.Claimed{row}, cl.localNow().Add(-2*lease))
	for _, o := range []string{"a", "b"} { // two lanes, three relays: c sorts last and gets none
		require.NoError(t, relaymode.BeatFence(ctx, s.DB, o, time.Hour, 25, fencing.FenceLanes))
	}
	cl.renewLanes(ctx)
	require.Equal(t, 2, owned("c"), "both lanes marked; the row is held: nothing given back yet")

	b := cl.claim(ctx, nil) // no lane to claim in: it forgets the row held past a lease
	require.NoError(t, b.err)
	require.Empty(t, b.claimed)
	b = cl.claim(ctx, nil) // nothing held: the marked lanes are given back
	require.NoError(t, b.err)
	require.Zero(t, owned("c"), "c gave back the lanes it had no share of")
}

// The wait between the passes of an idle relay whose lanes change hands
// grows to PollInterval, but to no less than 250 ms (a relay short of
// lanes held under a dead relay's lease renews at most four times a
// second, however small its PollInterval) and no more than
// MaxPollInterval. An idle relay reads its fair share as seldom: at most
// every PollInterval or 250 ms, the longer.
func TestTheHandOverWaitIsBounded(t *testing.T) {
	s := testdb.New(t)
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	for _, c := range []struct {
		poll, maxPoll, want time.Duration
	}{
		{10 * time.Millisecond, 0, 250 * time.Millisecond},
		{10 * time.Millisecond, 100 * time.Millisecond, 100 * time.Millisecond},
		{500 * time.Millisecond, 0, 500 * time.Millisecond},
		{2 * time.Second, 0, 2 * time.Second},
	} {
		f, err := New(s.DB, pub, nil,
			Config{Owner: "a", Fence: FenceLanes, PollInterval: c.poll, MaxPollInterval: c.maxPoll})
		require.NoError(t, err)
		require.Equal(t, c.want, f.claimer.motionMaxWait(), "PollInterval %s, MaxPollInterval %s", c.poll, c.maxPoll)
		require.Equal(t, max(c.poll, 250*time.Millisecond), f.claimer.laneCheckEvery(), "an idle pass reads the share at most this often")
	}
}

// laneSchema is a fresh schema with a table of lanes lanes.
func laneSchema(t *testing.T, lanes int) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	require.NoError(t, fencing.SetLaneCount(context.Background(), s.DB, lanes, 25))
	return s
}

// laneRelay is a lane relay of owner on s, not running: renewals an hour
// apart, its heartbeat written and the fence entered (it took what lanes
// were free up to its share). The test drives its renewals and claims.
func laneRelay(t *testing.T, s *testdb.Schema, owner string) *Forwarder {
	t.Helper()
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	f, err := New(s.DB, pub, nil, Config{Owner: owner, Fence: FenceLanes, HeartbeatInterval: time.Hour, LeaseDuration: time.Hour})
	require.NoError(t, err)
	require.NoError(t, relaymode.BeatFence(context.Background(), s.DB, owner, time.Hour, 25, fencing.FenceLanes))
	require.NoError(t, f.claimer.enterFence(context.Background()))
	return f
}

// lanesOwned counts the lanes owner holds under a live lease.
func lanesOwned(t *testing.T, s *testdb.Schema, owner string) int {
	t.Helper()
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_lane WHERE owner = $1 AND lease_expires_at > now()`, owner).Scan(&n))
	return n
}
