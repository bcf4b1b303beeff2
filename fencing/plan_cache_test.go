package fencing_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// A relay runs its claims as prepared statements (fencing.Prepared), and
// PostgreSQL plans a prepared statement afresh at every execution for as
// long as the custom plans it makes look cheaper than the generic one.
// Given the limit, a custom plan of the unkeyed lane claim of 1 to 10 rows
// always did: measured before the fix, each of 40 claims of 1 or of 10 rows
// was planned again, 2.3 and 3.1 ms a claim against 1.1 and 1.5 on the
// generic plan (BENCHMARKS.md, "Prepared claims and their plans"). The
// per-row claims on a backlog without keys were never switched: 0 generic
// plans in 50 claims, 46-48 µs of the server's CPU a claimed row at claims
// of 30 (BENCHMARKS.md, session 8). Every claim statement of either scheme,
// for a claim of any destination, must switch to its generic plan (the one
// the plan tests pin, genericConn) after a few executions, whatever its
// limit. The per-row claims' statements with destination filters, which
// they all ran before, never switch on such a backlog (fencing's
// anyDestination).
func TestClaimsSwitchToTheirGenericPlans(t *testing.T) {
	cases := []struct {
		name   string
		walk   bool
		policy fencing.OrderingPolicy
	}{
		{name: "unkeyed"},
		{name: "block-key", walk: true},
		{name: "skip-parked", walk: true, policy: fencing.SkipParked},
	}
	for _, tc := range cases {
		for _, limit := range []int{1, 100} {
			for _, scheme := range []string{"lanes", "rows"} {
				t.Run(fmt.Sprintf("%s/%s/limit=%d", scheme, tc.name, limit), func(t *testing.T) {
					t.Parallel()
					claimsSwitch(t, scheme, tc.policy, tc.walk, limit)
				})
			}
		}
	}
}

// claimsSwitch runs 12 claims of limit rows (each followed by its
// outcomes) through one prepared statement of scheme ("lanes" or "rows"),
// on 20,000 analyzed rows of which a quarter have keys, and requires that
// PostgreSQL switched the statement to its generic plan.
func claimsSwitch(t *testing.T, scheme string, policy fencing.OrderingPolicy, walk bool, limit int) {
	ctx := context.Background()
	var s *testdb.Schema
	if scheme == "lanes" {
		s = laneDB(t)
	} else {
		s = newDB(t)
	}
	fillOutbox(t, s.DB, 20000, 1024, `CASE WHEN g % 4 = 0 THEN 'k' || (g % 100) END`)
	_, err := s.DB.Exec(`ANALYZE messaging_outbox`)
	require.NoError(t, err)
	var r *laneRelay
	if scheme == "lanes" {
		r = takeLanes(t, s.DB, "r", time.Minute, 25)
	}
	conn, err := s.DB.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	p := fencing.NewPreparedConn(conn)
	defer p.Close()

	const claims = 12
	var claimed int
	for range claims {
		cp := fencing.ClaimParams{Owner: "r", Limit: limit, MaxAttempts: 25, Lease: time.Minute}
		if r != nil {
			cp = r.claimParams(limit)
		}
		cp.Policy, cp.NoKeyWalk = policy, !walk
		got, err := fencing.Claim(ctx, p, cp)
		require.NoError(t, err)
		claimed += len(got)
		out := make([]fencing.Outcome, 0, len(got))
		for _, c := range got {
			require.True(t, c.Held())
			out = append(out, fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished})
		}
		res, err := fencing.Apply(ctx, s.DB, out)
		require.NoError(t, err)
		for _, a := range res {
			require.Equal(t, fencing.Applied, a)
		}
	}
	require.Equal(t, claims*limit, claimed, "every claim was full")

	var generic, custom int
	require.NoError(t, conn.QueryRowContext(ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements
		WHERE statement LIKE '%messaging_outbox%'`).Scan(&generic, &custom))
	require.Equal(t, claims, generic+custom, "one prepared claim statement ran every claim")
	require.Positive(t, generic, "the claim switched to its generic plan (%d custom plans)", custom)
}

// The claims' custom plans, and their generic ones, read the claimable rows
// through an index on a large analyzed backlog without keys, the commonest
// outbox. A claim's first five executions on a connection run custom plans
// (and every execution of a per-row claim did in every case measured: its
// custom plans are estimated cheaper than the generic one). Hiding the per-row claims' limits and
// destination filters from the planner, so that they would switch too, was
// tried and undone: their custom plans then read the table whole and sorted
// it, 857 ms a claim on 200,000 rows instead of 3, because the filters then
// looked selective and the limit no longer cut the index scan's cost.
func TestCustomPlansOfTheClaimsReadNoTableWhole(t *testing.T) {
	s := laneDB(t)
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	fillOutbox(t, s.DB, 50000, 1024, `NULL`)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
	require.NoError(t, err)
	r := takeLanes(t, s.DB, "r", time.Minute, 25)
	conns := planConns(t, s.DB)
	for _, limit := range []int{1, 100} {
		for _, walk := range []bool{false, true} {
			rows := fencing.ClaimParams{Owner: "r", Limit: limit, MaxAttempts: 25, Lease: time.Minute, NoKeyWalk: !walk}
			lanes := r.claimParams(limit)
			lanes.NoKeyWalk = !walk
			for scheme, p := range map[string]fencing.ClaimParams{"rows": rows, "lanes": lanes} {
				q, args, err := fencing.ClaimStatement(p)
				require.NoError(t, err)
				for mode, conn := range conns {
					plan := testdb.ExplainPrepared(t, conn, "ANALYZE, COSTS OFF, TIMING OFF", q, args...)
					what := fmt.Sprintf("%s claim, limit %d, walk %v, %s", scheme, limit, walk, mode)
					// PostgreSQL 18 prints row counts with two decimals.
					require.Regexp(t, fmt.Sprintf(`^\S.*actual rows=%d(\.00)? `, limit), plan, "%s: the claim took its rows\n%s", what, plan)
					require.NotContains(t, plan, "Seq Scan on messaging_outbox", "%s\n%s", what, plan)
					require.NotContains(t, plan, "Bitmap Index Scan on messaging_outbox_lane_idx", "%s\n%s", what, plan)
				}
			}
		}
	}
}
