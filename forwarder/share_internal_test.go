package forwarder

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// A share that falls marks the lanes over it; while the relay still holds
// rows claimed before, nothing is given back. When the share rises again
// before those rows settle (the relay that joined left), the marked lanes
// are served again: unmarked at the next renewal, not given back once the
// rows settle and taken anew under new epochs (two epoch bumps, and the
// lanes' rows waiting meanwhile). The renewals are driven by hand and the
// fleet is heartbeats written by the test, so every step is an event.
func TestAShareThatRoseAgainUnmarksTheLanes(t *testing.T) {
	ctx := context.Background()
	s := laneSchema(t, 8)
	cl := laneRelay(t, s, "a").claimer

	epochs := func() map[int]int64 {
		t.Helper()
		cl.lanesMu.Lock()
		defer cl.lanesMu.Unlock()
		m := map[int]int64{}
		for _, l := range cl.lanes.owned {
			m[l.Lane] = l.Epoch
		}
		return m
	}
	marked := func() []int {
		cl.lanesMu.Lock()
		defer cl.lanesMu.Unlock()
		return slices.Sorted(maps.Keys(cl.lanes.draining))
	}
	before := epochs()
	require.Len(t, before, 8, "alone: every lane")

	// A row claimed before the fleet changes, its outcome not yet written.
	row := fencing.Claimed{Row: envelope.Row{MessageID: "m", Seq: 1, Status: envelope.StatusInFlight}}
	cl.hold([]fencing.Claimed{row}, cl.localNow())

	require.NoError(t, relaymode.BeatFence(ctx, s.DB, "b", time.Minute, 25, fencing.FenceLanes))
	cl.renewLanes(ctx)
	require.Len(t, marked(), 4, "b joined: a's share is 4, four lanes marked")
	require.Equal(t, before, epochs(), "a row is held: nothing given back yet")

	_, err := s.DB.Exec(`DELETE FROM messaging_relay_heartbeat WHERE owner = 'b'`)
	require.NoError(t, err)
	cl.renewLanes(ctx)
	require.Empty(t, marked(), "b left: the share is 8 again, the lanes are served again")

	cl.unhold([]fencing.Outcome{{Lease: fencing.Lease{MessageID: "m"}}})
	cl.renewLanes(ctx)
	require.Equal(t, before, epochs(), "the row settled: no lane was given back and taken anew")
	var changed int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_lane WHERE owner IS DISTINCT FROM 'a'`).Scan(&changed))
	require.Zero(t, changed, "a still owns every lane in the table")
}
