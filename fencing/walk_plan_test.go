package fencing_test

import (
	"database/sql"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// scanRows matches a scan of messaging_outbox in a text plan run with
// ANALYZE, TIMING OFF: the node and its actual rows and loops (PostgreSQL
// 18 prints the rows with two decimals).
var scanRows = regexp.MustCompile(`(Seq Scan|Index Scan|Index Only Scan|Bitmap Heap Scan|Tid Scan|Tid Range Scan) (?:using \S+ )?on messaging_outbox \S+ .*actual rows=(\d+)(?:\.\d+)? loops=(\d+)`)

// mostRowsScanned is the largest number of rows a single scan node of plan
// read from messaging_outbox over all its loops, and that node's line.
func mostRowsScanned(plan string) (int, string) {
	most, line := 0, ""
	for _, m := range scanRows.FindAllStringSubmatch(plan, -1) {
		rows, _ := strconv.Atoi(m[2])
		loops, _ := strconv.Atoi(m[3])
		if rows*loops > most {
			most, line = rows*loops, m[0]
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
				_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
					SELECT 'm' || g, 'd', convert_to(repeat('x', 200), 'UTF8'), ` + key + ` FROM generate_series(1, 20000) g`)
				require.NoError(t, err)
				if analyzed {
					_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
					require.NoError(t, err)
				}
				r := takeLanes(t, s.DB, "r", time.Minute, 25)
				conns := map[string]*sql.Conn{}
				for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
					conns[mode] = planConn(t, s.DB, mode)
				}
				for _, limit := range []int{10, 100} {
					p := r.claimParams(limit)
					p.NoKeyWalk = false
					p.MaxChain = 13
					q, args, err := fencing.ClaimStatement(p)
					require.NoError(t, err)
					for mode, conn := range conns {
						plan := testdb.ExplainPrepared(t, conn, "ANALYZE, COSTS OFF, TIMING OFF", q, args...)
						what := fmt.Sprintf("limit %d, %s", limit, mode)
						require.Regexp(t, fmt.Sprintf(`^\S.*actual rows=%d(\.00)? `, limit), plan, "%s: the claim took its rows\n%s", what, plan)
						most, line := mostRowsScanned(plan)
						require.NotZero(t, most, "%s: no scan of messaging_outbox found in the plan\n%s", what, plan)
						require.LessOrEqual(t, most, 4*limit+64, "%s: a scan read %d rows: %s\n%s", what, most, line, plan)
					}
				}
			})
		}
	}
}
