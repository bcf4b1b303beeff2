package fencing_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// cteRescans is the most rows one CTE scan of a plan read over all its
// loops beyond its first: a CTE read again for every row of another (a
// nested loop over CTEs) reads rows x rows.
func cteRescans(node map[string]any) (worst float64, where string) {
	if node["Node Type"] == "CTE Scan" {
		if loops, _ := node["Actual Loops"].(float64); loops > 1 {
			rows, _ := node["Actual Rows"].(float64)
			worst, where = rows*(loops-1), fmt.Sprintf("CTE Scan on %v: %v rows x %v loops", node["CTE Name"], rows, loops)
		}
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			if w, at := cteRescans(k.(map[string]any)); w > worst {
				worst, where = w, at
			}
		}
	}
	return worst, where
}

// claimParams are the parameters of r's next claim of up to limit rows.
func (r *laneRelay) claimParams(limit int) fencing.ClaimParams {
	return fencing.ClaimParams{Owner: r.owner, Limit: limit, MaxAttempts: 25,
		Lanes: r.lanes(), LaneCount: r.state.Total, HeldSeqs: r.held}
}

// The lane statements as a relay runs them (prepared, on their generic
// plans) read no CTE again for every row of another. On this backlog the
// outcome's fence did before it became one row of arrays: 14 lanes x 800
// loops, every row compared with every lane. The claims' nested loops over
// CTEs were measured in a drain under load (a keyed claim joining its
// unlocked candidates back to the candidate list, 1,500 x 1,500 rows, 770
// ms) and do not appear on this backlog; the claims are checked for the same
// shape.
func TestLaneStatementsReadNoCTEPerRow(t *testing.T) {
	ctx := context.Background()
	s := laneDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'm' || g, 'd', convert_to(repeat('x', 1024), 'UTF8'), CASE WHEN g % 4 = 0 THEN NULL ELSE 'k' || (g % 100) END FROM generate_series(1, 20000) g`)
	require.NoError(t, err)
	r := takeLanes(t, s.DB, "r", time.Minute, 25)

	// A first claim holds rows of every key; the second continues them.
	first := r.claimParams(800)
	first.MaxChain = 8
	held, err := fencing.Claim(ctx, s.DB, first)
	require.NoError(t, err)
	require.NotEmpty(t, held)
	second := r.claimParams(1000)
	seen := map[string]bool{}
	for _, c := range held {
		r.held = append(r.held, c.Row.Seq)
		if k := c.Row.OrderingKey; k != "" && !seen[k] {
			seen[k] = true
			second.Continue = append(second.Continue, fencing.Continuation{Key: k, AfterSeq: c.Row.Seq, AfterID: c.Row.MessageID})
		}
	}
	second.HeldSeqs = r.held

	conn := genericConn(t, s.DB)

	q, args, err := fencing.ClaimStatement(second)
	require.NoError(t, err)
	root := genericPlan(t, conn, q, args...)
	require.Positive(t, root["Actual Rows"], "the continued chains and more")
	worst, where := cteRescans(root)
	require.Less(t, worst, 1000.0, "keyed claim: %s", where)
	require.LessOrEqual(t, tidScanLoops(root, "messaging_outbox"), 1.0, "keyed claim: the held rows were read by a TID scan each")

	unkeyed := r.claimParams(1000)
	unkeyed.NoKeyWalk, unkeyed.HeldSeqs = true, r.held
	q, args, err = fencing.ClaimStatement(unkeyed)
	require.NoError(t, err)
	root = genericPlan(t, conn, q, args...)
	require.Positive(t, root["Actual Rows"])
	worst, where = cteRescans(root)
	require.Less(t, worst, 1000.0, "unkeyed claim: %s", where)

	outcomes := make([]fencing.Outcome, 0, len(held))
	for _, c := range held {
		if c.Held() {
			outcomes = append(outcomes, fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished})
		}
	}
	q, args = fencing.LaneApplyStatement(outcomes, false)
	root = genericPlan(t, conn, q, args...)
	require.EqualValues(t, len(outcomes), root["Actual Rows"], "every held row written")
	worst, where = cteRescans(root)
	require.Less(t, worst, float64(len(outcomes)), "outcome: %s", where)
}

// heapRowsRead is how many rows the scans of relation in a plan took from
// it, over all their loops: the rows they returned and those their filter
// removed.
func heapRowsRead(node map[string]any, relation string) float64 {
	var n float64
	if node["Relation Name"] == relation {
		loops, _ := node["Actual Loops"].(float64)
		rows, _ := node["Actual Rows"].(float64)
		removed, _ := node["Rows Removed by Filter"].(float64)
		n += (rows + removed) * max(loops, 1)
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			n += heapRowsRead(k.(map[string]any), relation)
		}
	}
	return n
}

// tidScanLoops is the most loops any TID scan of relation ran in a plan: a
// lane claim reads its held rows in one TID scan of the whole list (1), not
// one per row.
func tidScanLoops(node map[string]any, relation string) float64 {
	var most float64
	if node["Node Type"] == "Tid Scan" && node["Relation Name"] == relation {
		most, _ = node["Actual Loops"].(float64)
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			most = max(most, tidScanLoops(k.(map[string]any), relation))
		}
	}
	return most
}

// An unkeyed lane claim reads a lane in seq order and stops at its limit,
// however long the lane is: on its generic plan, with the claimability
// conditions in view, the planner expected them to keep one row of a lane
// and read every lane whole by a bitmap, then sorted it (a 1,000-row claim
// on a 200,000-row backlog read 6,271 rows of its first lane and took 87
// ms; a drain of that backlog ran at 7,400 msg/s against 17,000).
func TestLaneUnkeyedClaimStopsAtItsLimit(t *testing.T) {
	s := laneDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'd', '\x00' FROM generate_series(1, 100000) g`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
	require.NoError(t, err)
	r := takeLanes(t, s.DB, "r", time.Minute, 25)
	conn := genericConn(t, s.DB)

	p := r.claimParams(500)
	p.NoKeyWalk = true
	q, args, err := fencing.ClaimStatement(p)
	require.NoError(t, err)
	root := genericPlan(t, conn, q, args...)
	require.EqualValues(t, 500, root["Actual Rows"])
	// Each of the 500 rows is read twice (the lane walk, then its columns by
	// ctid); a lane read whole is 3,125 rows.
	require.LessOrEqual(t, heapRowsRead(root, "messaging_outbox"), 1200.0, "the claim read more than its rows: a lane read whole")
	require.LessOrEqual(t, tidScanLoops(root, "messaging_outbox"), 1.0, "the held rows were read by a TID scan each")
}

// bitmapScansOf counts the bitmap index scans of index in a plan.
func bitmapScansOf(node map[string]any, index string) int {
	n := 0
	if node["Node Type"] == "Bitmap Index Scan" && node["Index Name"] == index {
		n++
	}
	if kids, ok := node["Plans"].([]any); ok {
		for _, k := range kids {
			n += bitmapScansOf(k.(map[string]any), index)
		}
	}
	return n
}

// The full lane claim (the one that also walks the ordering keys: every
// claim of a relay while keyed rows wait) reads its lanes' unkeyed rows a
// run at a time, by descents of the lanes' index, as the unkeyed claim
// does. Its unkeyed half read each lane in one scan cut at the limit, and
// the planner made that a bitmap of every entry above the lane's floor,
// then a sort: a bitmap scan never marks the dead entries it meets, so
// every claim fetched the heap of every row published there since the
// floor last rose (a 100-row claim after 40,000 published rows: 1,051
// buffers, 2.4 times what it reads now, and growing with every row
// published).
func TestLaneClaimWithKeysReadsNoLaneWhole(t *testing.T) {
	s := laneDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'm' || g, 'd', '\x00', CASE WHEN g % 1000 = 0 THEN 'k' || g END FROM generate_series(1, 20000) g`)
	require.NoError(t, err)
	// The first half published, as by earlier claims whose floors have not
	// risen yet (they are 0 until fencing.AdvanceLaneFloors raises them).
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'PUBLISHED', published_at = now(), attempts = 1
		WHERE seq <= (SELECT min(seq) + 9999 FROM messaging_outbox)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
	require.NoError(t, err)
	var firstLive int64
	require.NoError(t, s.DB.QueryRow(`SELECT min(seq) FROM messaging_outbox WHERE published_at IS NULL`).Scan(&firstLive))
	r := takeLanes(t, s.DB, "r", time.Minute, 25)
	conn := genericConn(t, s.DB)

	p := r.claimParams(100)
	q, args, err := fencing.ClaimStatement(p)
	require.NoError(t, err)
	root := genericPlan(t, conn, q, args...)
	require.EqualValues(t, 100, root["Actual Rows"])
	require.Zero(t, bitmapScansOf(root, "messaging_outbox_lane_idx"), "a lane was read through a bitmap of its index")
	got, err := fencing.Claim(context.Background(), s.DB, p)
	require.NoError(t, err)
	require.Len(t, got, 100)
	for _, c := range got {
		require.GreaterOrEqual(t, c.Row.Seq, firstLive, "a published row was claimed")
	}
}
