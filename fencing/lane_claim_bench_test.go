package fencing_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// A lane claim in a relay's steady state: 1,000 unkeyed rows of 1 KB with
// UUID message ids (36 bytes, as most services write them), while the relay
// still holds the 2,000 rows of its two earlier claims (what prefetch keeps
// in flight), on 32 lanes. Each iteration claims the next 1,000 rows and
// writes the oldest held batch PUBLISHED, as the relay does. The metric is
// the server's execution time per claimed row, from EXPLAIN (ANALYZE,
// TIMING OFF) of the claim (run in a transaction rolled back, then again for
// real): the client's decoding is left out. Run with
// `go test -run '^$' -bench LaneClaimHoldingRows -benchtime 40x ./fencing/`.
func BenchmarkLaneClaimHoldingRows(b *testing.B) {
	ctx := context.Background()
	s := testdb.New(b)
	if err := fencing.SetLaneCount(ctx, s.DB, 32, 25); err != nil {
		b.Fatal(err)
	}
	exec := func(q string, args ...any) {
		b.Helper()
		if _, err := s.DB.Exec(q, args...); err != nil {
			b.Fatal(err)
		}
	}
	exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT md5(g::text)::uuid::text, 'd', convert_to(repeat('x', 1000), 'UTF8') FROM generate_series(1, $1::int) g`, 1000*(b.N+3))
	exec(`VACUUM ANALYZE messaging_outbox`)
	st, err := fencing.TakeLanes(ctx, s.DB, fencing.LaneParams{Owner: "r", TTL: time.Hour, MaxAttempts: 25})
	if err != nil {
		b.Fatal(err)
	}
	lanes := make([]int, len(st.Owned))
	for i, l := range st.Owned {
		lanes[i] = l.Lane
	}
	var batches [][]fencing.Claimed
	claim := func() ([]fencing.Claimed, float64) {
		b.Helper()
		p := fencing.ClaimParams{Owner: "r", Limit: 1000, MaxAttempts: 25, Lanes: lanes, LaneCount: st.Total, NoKeyWalk: true}
		for _, batch := range batches {
			for _, c := range batch {
				p.HeldSeqs = append(p.HeldSeqs, c.Row.Seq)
			}
		}
		if n := len(batches); n > 0 {
			last := batches[n-1]
			p.FromSeq = last[len(last)-1].Row.Seq + 1
		}
		q, args, err := fencing.ClaimStatement(p)
		if err != nil {
			b.Fatal(err)
		}
		ms := explainMs(b, s, q, args...)
		got, err := fencing.Claim(ctx, s.DB, p)
		if err != nil || len(got) != 1000 {
			b.Fatalf("claimed %d rows: %v", len(got), err)
		}
		return got, ms
	}
	for range 2 { // the steady state: two batches held
		got, _ := claim()
		batches = append(batches, got)
	}
	var total float64
	b.ResetTimer()
	for range b.N {
		got, ms := claim()
		total += ms
		batches = append(batches, got)
		outcomes := make([]fencing.Outcome, len(batches[0]))
		for i, c := range batches[0] {
			outcomes[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished}
		}
		if _, err := fencing.Apply(ctx, s.DB, outcomes); err != nil {
			b.Fatal(err)
		}
		batches = batches[1:]
	}
	b.ReportMetric(total*1000/float64(b.N)/1000, "us/row")
}

// explainMs runs q under EXPLAIN (ANALYZE, TIMING OFF) in a transaction it
// rolls back and returns the execution time in milliseconds.
func explainMs(b *testing.B, s *testdb.Schema, q string, args ...any) float64 {
	b.Helper()
	tx, err := s.DB.Begin()
	if err != nil {
		b.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck // read-only use, rolled back
	var raw []byte
	if err := tx.QueryRow("EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) "+q, args...).Scan(&raw); err != nil {
		b.Fatal(err)
	}
	var plan []struct {
		Exec float64 `json:"Execution Time"`
	}
	if err := json.Unmarshal(raw, &plan); err != nil {
		b.Fatal(err)
	}
	return plan[0].Exec
}
