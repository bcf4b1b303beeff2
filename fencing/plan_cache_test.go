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

// A relay runs its claims as prepared statements (fencing.Prepared), and
// PostgreSQL plans a prepared statement afresh at every execution for as
// long as the custom plans it makes look cheaper than the generic one.
// Given the limit, the destinations and the other parameters' values, a
// custom plan of a small claim always did: measured before the fix, every
// one of 250 claims of 1 or 10 rows was planned again (of 100 rows too,
// in the per-row scheme), and the claim that
// walks the keys spent 1.5-2.6 ms planning against 0.3-0.6 ms running.
// Every claim statement, in both fence schemes, must switch to its generic
// plan (the one the plan tests pin, genericConn) after a few executions,
// whatever its limit.
func TestClaimsSwitchToTheirGenericPlans(t *testing.T) {
	cases := []struct {
		name   string
		lanes  bool
		walk   bool
		policy fencing.OrderingPolicy
	}{
		{name: "rows/unkeyed"},
		{name: "rows/block-key", walk: true},
		{name: "rows/skip-parked", walk: true, policy: fencing.SkipParked},
		{name: "lanes/unkeyed", lanes: true},
		{name: "lanes/block-key", lanes: true, walk: true},
		{name: "lanes/skip-parked", lanes: true, walk: true, policy: fencing.SkipParked},
	}
	for _, tc := range cases {
		for _, limit := range []int{1, 100} {
			t.Run(fmt.Sprintf("%s/limit=%d", tc.name, limit), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				s := newDB(t)
				if tc.lanes {
					s = laneDB(t)
				}
				_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
					SELECT 'm' || g, 'd', convert_to(repeat('x', 1024), 'UTF8'), CASE WHEN g % 4 = 0 THEN 'k' || (g % 100) END
					  FROM generate_series(1, 20000) g`)
				require.NoError(t, err)
				_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
				require.NoError(t, err)
				var r *laneRelay
				if tc.lanes {
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
					cp := fencing.ClaimParams{Owner: "r", Limit: limit, MaxAttempts: 25, Lease: time.Minute, Policy: tc.policy, NoKeyWalk: !tc.walk}
					if r != nil {
						cp.Lease, cp.Lanes, cp.LaneCount, cp.HeldSeqs = 0, r.lanes(), r.state.Total, r.held
					}
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
			})
		}
	}
}
