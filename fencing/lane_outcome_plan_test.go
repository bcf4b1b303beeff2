package fencing_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The lane scheme's statements that find rows by message id (the outcome,
// all PUBLISHED or general) cannot be served by the claimable indexes: "neither
// published nor parked" is written so that no partial index matches it,
// and the rows are probed by id. With the claimable index usable, the
// planner read the whole of it whenever its estimates made it look small
// (stale statistics, a grown table): 18,000 entries filtered for 1,000
// outcomes, and with a snapshot held every dead entry besides (132 ms a
// statement after four rounds of 20,000 rows). Without the primary key
// (dropped in a rolled-back transaction) and with sequential scans
// disabled, a statement that could use a claimable index would show it in
// its plan. A takeover's charge of what the lapsed owner held finds its
// rows by seq (the held record lists seqs), and the table's only index on
// seq is a claimable one: it reads that index at the listed seqs only (an
// index condition), never the whole of it.
func TestLaneStatementsByIDUseNoClaimableIndex(t *testing.T) {
	s := laneDB(t)
	ctx := context.Background()
	for i := range 20 {
		insert(t, s.DB, fmt.Sprintf("m%02d", i), "")
	}
	relay := takeLanes(t, s.DB, "a", 60e9, 25)
	got := relay.claim(t, s.DB, 25)
	require.Len(t, got, 20)
	outs := make([]fencing.Outcome, len(got))
	for i, c := range got {
		outs[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished}
	}
	type stmt struct {
		name string
		q    string
		args []any
	}
	var stmts []stmt
	for _, general := range []bool{false, true} {
		q, args := fencing.LaneApplyStatement(outs, general)
		stmts = append(stmts, stmt{fmt.Sprintf("outcome (general %v)", general), q, args})
	}
	stmts = append(stmts, stmt{"takeover", fencing.TakeLanesSQL, []any{"b", 60.0, 25}})
	for _, st := range stmts {
		tx, err := s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		for _, q := range []string{`ALTER TABLE messaging_outbox DROP CONSTRAINT messaging_outbox_pkey`, `SET LOCAL enable_seqscan = off`} {
			_, err = tx.Exec(q)
			require.NoError(t, err)
		}
		plan := testdb.ExplainIn(t, tx, st.q, st.args...)
		require.NoError(t, tx.Rollback())
		require.Contains(t, plan, "messaging_outbox", st.name)
		if st.name != "takeover" {
			require.NotContains(t, plan, "claimable_idx", "%s:\n%s", st.name, plan)
			continue
		}
		lines := strings.Split(plan, "\n")
		reads := 0
		for i, l := range lines {
			if strings.Contains(l, "claimable_idx") {
				reads++
				require.Less(t, i+1, len(lines))
				require.Contains(t, lines[i+1], "Index Cond: (seq = ANY", "takeover:\n%s", plan)
			}
		}
		require.Positive(t, reads, "takeover: the held rows are found through the claimable index:\n%s", plan)
	}
}

// The lane scheme's all-PUBLISHED outcome finds its rows through the
// primary key, on custom and generic plans, with statistics or without, on
// a table of 100,000 rows. A cheaper form was tried and dropped for this:
// joined with arrays of ids, epochs and attempts instead of reading each
// row's from a JSON object (three lookups a row), the statement cost 0.6
// µs a row less, but a custom plan on the never-analyzed table read the
// whole table into a hash (304,129 rows produced for 1,000 outcomes), and
// with "message_id = ANY (ids)" kept beside the join the generic plan read
// the arrays again for every row (150 ms a write).
func TestLanePublishedOutcomeReadsOnlyItsRows(t *testing.T) {
	ctx := context.Background()
	s := laneDB(t)
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'd', '' FROM generate_series(1, 100000) g`)
	require.NoError(t, err)
	r := takeLanes(t, s.DB, "r", time.Minute, 25)
	held, err := fencing.Claim(ctx, s.DB, r.claimParams(1000))
	require.NoError(t, err)
	require.Len(t, held, 1000)
	outcomes := make([]fencing.Outcome, len(held))
	for i, c := range held {
		outcomes[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished}
	}
	q, args := fencing.LaneApplyStatement(outcomes, false)
	conn, err := s.DB.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	for _, analyzed := range []bool{false, true} {
		if analyzed {
			_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
			require.NoError(t, err)
		}
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			_, err = conn.ExecContext(ctx, `SET plan_cache_mode = `+mode)
			require.NoError(t, err)
			root := genericPlan(t, conn, q, args...)
			require.Equal(t, 1000.0, root["Actual Rows"], "%s, analyzed %v: every row written", mode, analyzed)
			require.LessOrEqual(t, rowsProduced(root), 4*1000.0, "%s, analyzed %v: rows produced by the plan %v", mode, analyzed, scans(root))
			require.NotContains(t, scans(root), "Seq Scan on messaging_outbox", "%s, analyzed %v", mode, analyzed)
		}
	}
}
