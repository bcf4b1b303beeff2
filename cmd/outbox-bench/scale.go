package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

// probeOwner names the lease owner of claim probes; their transaction is
// rolled back, so no row keeps it.
const probeOwner = "bench-probe"

// probeParams is the claim a forwarder at defaults makes first: a full
// batch, BlockKey, chains capped at ceil(BatchSize/Concurrency) rows per key
// (the forwarder's chain cap), the key walk starting at the smallest key.
func probeParams() fencing.ClaimParams {
	return fencing.ClaimParams{
		Owner: probeOwner, Limit: forwarder.DefaultBatchSize, Lease: forwarder.DefaultLeaseDuration,
		MaxAttempts: forwarder.DefaultMaxAttempts, Policy: fencing.BlockKey,
		MaxChain: (forwarder.DefaultBatchSize + forwarder.DefaultConcurrency - 1) / forwarder.DefaultConcurrency,
	}
}

// claimOnce times one full-batch claim in a transaction that is rolled
// back, so the backlog is unchanged for the next probe.
func claimOnce(ctx context.Context, db *sql.DB) (time.Duration, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	start := time.Now()
	got, err := fencing.Claim(ctx, tx, probeParams())
	if err != nil {
		return 0, err
	}
	d := time.Since(start)
	if len(got) == 0 {
		return 0, fmt.Errorf("claim probe found no claimable row")
	}
	return d, nil
}

func claimLatencies(ctx context.Context, db *sql.DB, probes int) ([]time.Duration, error) {
	out := make([]time.Duration, 0, probes)
	for range probes {
		d, err := claimOnce(ctx, db)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}

// explainClaim returns EXPLAIN (ANALYZE, BUFFERS) of the forwarder's claim
// with the parameters the forwarder uses, rolled back.
func explainClaim(ctx context.Context, db *sql.DB) (string, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return "", err
	}
	defer func() { _ = tx.Rollback() }()
	q, args, err := fencing.ClaimStatement(probeParams())
	if err != nil {
		return "", err
	}
	rows, err := tx.QueryContext(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+q, args...)
	if err != nil {
		return "", fmt.Errorf("explain claim: %w", err)
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			return "", err
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	return b.String(), rows.Err()
}

// scaleResult is one backlog size's numbers.
type scaleResult struct {
	throughput float64 // msg/s, one relay, defaults
	claimP50   float64 // ms
	claimP99   float64 // ms
	explain    string
	wal        []WALCost
	server     serverActivity // during the drain, per relayed row where it says so
}

// serverActivity is what the whole server did during a drain, from its
// cumulative statistics (pg_stat_wal, pg_stat_bgwriter): why a drain of a
// large backlog costs more per row than a small one (full-page images after
// each checkpoint, backends writing out dirty buffers themselves). These
// counters are server-wide; on a shared server they include other users'.
type serverActivity struct {
	WALBytes      float64 // per row
	FPI           float64 // full-page images per row
	Checkpoints   float64 // checkpoints started during the drain
	BackendWrites float64 // buffers written by backends (no clean buffer free), per row
}

const sqlServerActivity = `
SELECT w.wal_bytes::float8, w.wal_fpi::float8,
       (b.checkpoints_timed + b.checkpoints_req)::float8, b.buffers_backend::float8
  FROM pg_stat_wal w, pg_stat_bgwriter b`

// readServerActivity reads the counters once every other session of the
// bench database has ended. A backend adds its WAL counters to pg_stat_wal
// only now and then while it runs, and always when it exits, so the pool's
// idle connections are closed first and the read waits (polling, bounded)
// for the other backends to be gone.
func readServerActivity(ctx context.Context, db *sql.DB) (serverActivity, error) {
	var a serverActivity
	db.SetMaxIdleConns(0) // closes the idle connections: their backends exit
	defer db.SetMaxIdleConns(2)
	conn, err := db.Conn(ctx)
	if err != nil {
		return a, err
	}
	defer conn.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var others int
		if err := conn.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&others); err != nil {
			return a, err
		}
		if others == 0 {
			break
		}
		if time.Now().After(deadline) {
			return a, fmt.Errorf("server activity: %d other sessions still connected after 10s", others)
		}
		select {
		case <-ctx.Done():
			return a, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	// Statistics are read from a snapshot per transaction; a fresh one here.
	if _, err := conn.ExecContext(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
		return a, err
	}
	err = conn.QueryRowContext(ctx, sqlServerActivity).Scan(&a.WALBytes, &a.FPI, &a.Checkpoints, &a.BackendWrites)
	return a, err
}

// per returns the activity between a and b, per row where the field says so.
func (b serverActivity) per(a serverActivity, rows int) serverActivity {
	n := float64(rows)
	return serverActivity{
		WALBytes: (b.WALBytes - a.WALBytes) / n, FPI: (b.FPI - a.FPI) / n,
		Checkpoints: b.Checkpoints - a.Checkpoints, BackendWrites: (b.BackendWrites - a.BackendWrites) / n,
	}
}

// scaleCell prefills n rows, probes the claim, then drains with one relay.
func scaleCell(ctx context.Context, e *env, n int, payload []byte, probes int, explain bool, timeout time.Duration) (scaleResult, error) {
	var res scaleResult
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return res, err
	}
	defer s.drop()
	if err := prefill(ctx, s.db, prefillOutbox, "ob-", n, payload); err != nil {
		return res, err
	}
	lat, err := claimLatencies(ctx, s.db, probes)
	if err != nil {
		return res, err
	}
	res.claimP50, res.claimP99 = percentileMS(lat, 50), percentileMS(lat, 99)
	if explain {
		if res.explain, err = explainClaim(ctx, s.db); err != nil {
			return res, err
		}
		if res.wal, err = walCosts(ctx, s.db, payload); err != nil {
			return res, err
		}
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	snk, err := newSink(sctx, n)
	if err != nil {
		return res, err
	}
	defer snk.close()
	before, err := readServerActivity(ctx, s.db)
	if err != nil {
		return res, err
	}
	start := time.Now()
	r, err := startRelay(sctx, s, relayOurs, 1, snk.ch, false)
	if err != nil {
		return res, err
	}
	defer r.stop()
	select {
	case <-snk.done:
	case <-time.After(timeout):
		return res, fmt.Errorf("scale %d: only %d messages arrived within %s", n, snk.count.Load(), timeout)
	}
	res.throughput = float64(n) / time.Since(start).Seconds()
	r.stop() // its backends exit and report their counters
	after, err := readServerActivity(ctx, s.db)
	if err != nil {
		return res, err
	}
	res.server = after.per(before, n)
	return res, nil
}

// retentionResult: claim latency alone and while retention deletes.
type retentionResult struct {
	claimIdleP50, claimIdleP99     float64 // ms, no retention running
	claimDuringP50, claimDuringP99 float64 // ms, while the cleaner deletes
	deleted                        int
	seconds                        float64 // the cleaner's run
}

// retentionCell prefills published (old, PUBLISHED) rows and pending rows,
// then probes the claim before and while retention deletes the published
// ones in its bounded batches.
func retentionCell(ctx context.Context, e *env, published, pending int, payload []byte, probes int) (retentionResult, error) {
	var res retentionResult
	s, err := e.newSchema(ctx, 3)
	if err != nil {
		return res, err
	}
	defer s.drop()
	if err := prefill(ctx, s.db, prefillPublished, "pub-", published, payload); err != nil {
		return res, err
	}
	if err := prefill(ctx, s.db, prefillOutbox, "ob-", pending, payload); err != nil {
		return res, err
	}
	lat, err := claimLatencies(ctx, s.db, probes)
	if err != nil {
		return res, err
	}
	res.claimIdleP50, res.claimIdleP99 = percentileMS(lat, 50), percentileMS(lat, 99)

	cleaner, err := retention.New(s.db, nil, retention.Config{
		MaxBatches: published/retention.DefaultBatchSize + 2,
	})
	if err != nil {
		return res, err
	}
	type out struct {
		r   retention.Result
		err error
	}
	done := make(chan out, 1)
	start := time.Now()
	go func() {
		r, err := cleaner.Run(ctx)
		done <- out{r, err}
	}()
	var during []time.Duration
	var o out
loop:
	for {
		select {
		case o = <-done:
			break loop
		default:
		}
		d, err := claimOnce(ctx, s.db)
		if err != nil {
			o = <-done
			return res, err
		}
		during = append(during, d)
	}
	res.seconds = time.Since(start).Seconds()
	if o.err != nil {
		return res, fmt.Errorf("retention: %w", o.err)
	}
	res.deleted = o.r.Deleted
	if len(during) == 0 {
		// The cleaner finished before the first probe: probe once after.
		d, err := claimOnce(ctx, s.db)
		if err != nil {
			return res, err
		}
		during = append(during, d)
	}
	res.claimDuringP50, res.claimDuringP99 = percentileMS(during, 50), percentileMS(during, 99)
	return res, nil
}
