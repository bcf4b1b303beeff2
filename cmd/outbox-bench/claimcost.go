package main

import (
	"context"
	"fmt"
	"time"
)

// Claim cost under blocked keys (issue 14): the claim's latency with many
// rows queued behind a parked head, and with many keys, each beside a clean
// claim over a backlog of the same size.
//
// Every case is one fresh schema, probed cfg.ClaimProbes times with a full
// claim (probeParams: the forwarder's defaults, BlockKey, its chain cap) in
// a transaction that is rolled back, so every probe sees the same backlog.
//
//   - parked-head: the head of key "a-parked" (the first key of the walk,
//     whatever the cursor: the worst place) is EXHAUSTED and parked, and
//     ParkedBehind PENDING rows of that key are behind it, interleaved in
//     seq with ParkedBehind rows of 100 other keys, so the claim has work.
//   - parked-head-clean: the same rows, the head PENDING (not parked): the
//     target's "clean claim at the same backlog size".
//   - unkeyed at that size: the same number of rows without keys (the
//     claim's unkeyed index scan alone), as evidence.
//   - keys: ClaimKeys keys x ClaimPerKey rows, interleaved, beside unkeyed
//     rows of the same count.
const (
	parkedKey = "a-parked"
	// parkedHead is the parked head row: EXHAUSTED, its budget spent.
	parkedHeadRow = `INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key, status, attempts, parked_at,
    last_failure_code, last_failure_detail)
VALUES ('parked-head', $1, $2, '` + parkedKey + `', 'EXHAUSTED', 10, now(), 'BENCH', 'parked by the benchmark')`
	// pendingHeadRow is the same head, PENDING.
	pendingHeadRow = `INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
VALUES ('parked-head', $1, $2, '` + parkedKey + `')`
	// behindParked: even g are rows of the parked key, odd g rows of 100
	// other keys.
	behindParked = `CASE WHEN g % 2 = 0 THEN '` + parkedKey + `' ELSE 'k' || (g / 2 % 100) END`
)

func claimCostName(c, p string) string { return fmt.Sprintf("claimcost/%s/%s", c, p) }

// claimCostCases are the cases' names, in run order.
func claimCostCases(cfg Config) []string {
	parkedN, keysN := 2*cfg.ParkedBehind+1, cfg.ClaimKeys*cfg.ClaimPerKey
	return []string{"parked-head", "parked-head-clean", fmt.Sprintf("unkeyed-%d", parkedN),
		fmt.Sprintf("keys%dx%d", cfg.ClaimKeys, cfg.ClaimPerKey), fmt.Sprintf("unkeyed-%d", keysN)}
}

func runClaimCost(ctx context.Context, e *env, cfg Config, c *collector, rep *Report, explain bool, payload []byte, logf func(string, ...any)) error {
	cases := claimCostCases(cfg)
	parkedN, keysN := 2*cfg.ParkedBehind+1, cfg.ClaimKeys*cfg.ClaimPerKey
	fills := []func(s *schema) error{
		func(s *schema) error { return fillParked(ctx, s, cfg.ParkedBehind, payload, true) },
		func(s *schema) error { return fillParked(ctx, s, cfg.ParkedBehind, payload, false) },
		func(s *schema) error { return prefillRows(ctx, s.db, "ob-", parkedN, payload, unkeyed, "") },
		func(s *schema) error {
			return prefillRows(ctx, s.db, "ob-", keysN, payload, keyedBy(cfg.ClaimKeys), "")
		},
		func(s *schema) error { return prefillRows(ctx, s.db, "ob-", keysN, payload, unkeyed, "") },
	}
	for i, name := range cases {
		p50, p99, plan, err := claimCostCell(ctx, e, fills[i], cfg.ClaimProbes, explain && i == 0)
		if err != nil {
			return fmt.Errorf("claim cost %s: %w", name, err)
		}
		if plan != "" {
			rep.ExplainParkedHead = plan
		}
		c.add("claimcost", claimCostName(name, "p50"), "ms", p50)
		c.add("claimcost", claimCostName(name, "p99"), "ms", p99)
		logf("  %-28s claim p50 %.2f ms p99 %.2f ms", "claimcost/"+name, p50, p99)
	}
	return nil
}

// fillParked writes the head of parkedKey (parked or not), then behind rows
// of it interleaved with behind rows of other keys.
func fillParked(ctx context.Context, s *schema, behind int, payload []byte, parked bool) error {
	head := pendingHeadRow
	if parked {
		head = parkedHeadRow
	}
	if _, err := s.db.ExecContext(ctx, head, benchTopic, payload); err != nil {
		return fmt.Errorf("head row: %w", err)
	}
	return prefillRows(ctx, s.db, "ob-", 2*behind, payload, behindParked, "")
}

func claimCostCell(ctx context.Context, e *env, fill func(*schema) error, probes int, explain bool) (p50, p99 float64, plan string, err error) {
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return 0, 0, "", err
	}
	defer s.drop()
	if err := fill(s); err != nil {
		return 0, 0, "", err
	}
	// One claim first, untimed: the plan is cached and the pages are read
	// once, as for a relay that has been running.
	if _, err := claimOnce(ctx, s.db); err != nil {
		return 0, 0, "", err
	}
	lat := make([]time.Duration, 0, probes)
	for range probes {
		d, err := claimOnce(ctx, s.db)
		if err != nil {
			return 0, 0, "", err
		}
		lat = append(lat, d)
	}
	if explain {
		if plan, err = explainClaim(ctx, s.db); err != nil {
			return 0, 0, "", err
		}
	}
	return percentileMS(lat, 50), percentileMS(lat, 99), plan, nil
}
