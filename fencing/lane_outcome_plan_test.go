package fencing_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The lane scheme's statements that find rows by message id (the outcome,
// all PUBLISHED or general, and a takeover's charge of what the lapsed
// owner held) cannot be served by the claimable indexes: "neither
// published nor parked" is written so that no partial index matches it,
// and the rows are probed by id. With the claimable index usable, the
// planner read the whole of it whenever its estimates made it look small
// (stale statistics, a grown table): 18,000 entries filtered for 1,000
// outcomes, and with a snapshot held every dead entry besides (132 ms a
// statement after four rounds of 20,000 rows). Without the primary key
// (dropped in a rolled-back transaction) and with sequential scans
// disabled, a statement that could use a claimable index would show it in
// its plan.
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
		require.NotContains(t, plan, "claimable_idx", "%s:\n%s", st.name, plan)
	}
}
