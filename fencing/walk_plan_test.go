package fencing_test

import (
	"database/sql"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// scanNode matches a scan of messaging_outbox in a text plan run with
// ANALYZE, TIMING OFF, with its actual rows and loops (PostgreSQL 18 prints
// the rows with two decimals); removed matches a "Rows Removed by ..." line
// of the node's details.
var (
	scanNode = regexp.MustCompile(`(Seq Scan|Index Scan|Index Only Scan|Bitmap Heap Scan|Tid Scan|Tid Range Scan) (?:using \S+ )?on messaging_outbox \S+ .*actual rows=(\d+)(?:\.\d+)? loops=(\d+)`)
	removed  = regexp.MustCompile(`^\s+Rows Removed by (?:Filter|Index Recheck): (\d+)`)
)

// mostRowsScanned is the largest number of rows a single scan node of plan
// read from messaging_outbox over all its loops (the rows it returned and
// those its filters removed; EXPLAIN prints both per loop), and that node's
// line.
func mostRowsScanned(plan string) (int, string) {
	most, line := 0, ""
	lines := strings.Split(plan, "\n")
	for i, l := range lines {
		m := scanNode.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		rows, _ := strconv.Atoi(m[2])
		loops, _ := strconv.Atoi(m[3])
		// The node's details follow it, up to the next node (a line that
		// starts with "->"; a detail may hold jsonb's ->> operator).
		for _, d := range lines[i+1:] {
			if strings.HasPrefix(strings.TrimSpace(d), "->") {
				break
			}
			if r := removed.FindStringSubmatch(d); r != nil {
				n, _ := strconv.Atoi(r[1])
				rows += n
			}
		}
		if rows*loops > most {
			most, line = rows*loops, strings.TrimSpace(l)
		}
	}
	return most, line
}

// The lane claim that walks the ordering keys reads each candidate row the
// walk found by its ctid. Written as a join of the candidates with the
// table, the planner could drive the join from the table instead: on a
// backlog without keys (no candidate at all) it read every claimable row
// through messaging_outbox_claimable_idx and matched each against the
// empty candidate list (a relay's every eighth claim on such a backlog, 13.9
// ms a claim on 20,000 rows and growing with the backlog; seen on a table
// not analyzed since it filled, as a fresh backlog is). The candidates now
// drive a TID lookup each. Checked on the generic and the custom plans, with
// the table's statistics stale (never analyzed) and fresh, on a backlog
// without keys and on one where some rows have keys: no scan of the table
// reads more than a few times the claim's limit.
func TestLaneWalkClaimReadsOnlyItsCandidates(t *testing.T) {
	forEachPlanBacklog(t, func(t *testing.T, r *laneRelay, conns map[string]*sql.Conn) {
		for _, limit := range []int{10, 100} {
			p := r.claimParams(limit)
			p.MaxChain = 13
			requireScansNearLimit(t, conns, p, fmt.Sprintf("lane walk claim, limit %d", limit))
		}
	})
}

// Every claim statement, of both schemes, with and without the walk over
// keys, under both ordering policies, for any destination and with one
// excluded (the statements with destination filters), holds to the same
// bound as the lane walk claim above on the same backlogs.
func TestEveryClaimReadsNearItsLimit(t *testing.T) {
	forEachPlanBacklog(t, func(t *testing.T, r *laneRelay, conns map[string]*sql.Conn) {
		for _, limit := range []int{10, 100} {
			for _, walk := range []bool{false, true} {
				for _, policy := range []fencing.OrderingPolicy{fencing.BlockKey, fencing.SkipParked} {
					for _, excluded := range [][]string{nil, {"elsewhere"}} {
						rows := fencing.ClaimParams{Owner: "r", Limit: limit, MaxAttempts: 25, Lease: time.Minute, MaxChain: 13}
						lanes := r.claimParams(limit)
						lanes.MaxChain = 13
						for scheme, p := range map[string]fencing.ClaimParams{"rows": rows, "lanes": lanes} {
							p.NoKeyWalk, p.Policy, p.ExcludeDestinations = !walk, policy, excluded
							requireScansNearLimit(t, conns, p, fmt.Sprintf("%s claim, limit %d, walk %v, policy %d, excluded %v", scheme, limit, walk, policy, excluded))
						}
					}
				}
			}
		}
	})
}

// forEachPlanBacklog runs check on four backlogs of 20,000 rows, with the
// table's statistics stale (never analyzed, autovacuum off) and fresh, all
// rows unkeyed or one in ten on one of 7 ordering keys, with 32 lanes all
// owned by relay r, and a connection forcing generic and one forcing custom
// plans.
func forEachPlanBacklog(t *testing.T, check func(t *testing.T, r *laneRelay, conns map[string]*sql.Conn)) {
	for _, analyzed := range []bool{false, true} {
		for _, keyed := range []bool{false, true} {
			t.Run(fmt.Sprintf("analyzed=%v,keyed=%v", analyzed, keyed), func(t *testing.T) {
				s := laneDB(t)
				_, err := s.DB.Exec(`ALTER TABLE messaging_outbox SET (autovacuum_enabled = false)`)
				require.NoError(t, err)
				key := `NULL`
				if keyed {
					key = `CASE WHEN g % 10 = 0 THEN 'k' || (g % 7) END`
				}
				fillOutbox(t, s.DB, 20000, 200, key)
				if analyzed {
					_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
					require.NoError(t, err)
				}
				r := takeLanes(t, s.DB, "r", time.Minute, 25)
				check(t, r, planConns(t, s.DB))
			})
		}
	}
}

// requireScansNearLimit explains the claim p (run and rolled back) on
// each connection of conns: it must take its limit of rows, and no scan of
// messaging_outbox may read more than four times the limit plus 64 rows
// (the descents of the lanes' runs: one per lane).
func requireScansNearLimit(t *testing.T, conns map[string]*sql.Conn, p fencing.ClaimParams, what string) {
	t.Helper()
	q, args, err := fencing.ClaimStatement(p)
	require.NoError(t, err)
	for mode, conn := range conns {
		plan := testdb.ExplainPrepared(t, conn, "ANALYZE, COSTS OFF, TIMING OFF", q, args...)
		require.Regexp(t, fmt.Sprintf(`^\S.*actual rows=%d(\.00)? `, p.Limit), plan, "%s, %s: the claim took its rows\n%s", what, mode, plan)
		most, line := mostRowsScanned(plan)
		require.NotZero(t, most, "%s, %s: no scan of messaging_outbox found in the plan\n%s", what, mode, plan)
		require.LessOrEqual(t, most, 4*p.Limit+64, "%s, %s: a scan read %d rows: %s\n%s", what, mode, most, line, plan)
	}
}
