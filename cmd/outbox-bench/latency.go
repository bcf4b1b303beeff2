package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// latencyCell writes one message per transaction at rate msg/s for dur
// and returns p50 and p99 of commit-to-receipt latency in ms: from the
// moment Commit returned to the moment the downstream subscriber got the
// message (zero if the message arrived before Commit returned, which
// LISTEN/NOTIFY makes possible).
func latencyCell(ctx context.Context, e *env, kind string, rate int, dur time.Duration, payload []byte) (p50, p99 float64, err error) {
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return 0, 0, err
	}
	defer s.drop()
	impl := implPublisherNotify
	if kind != relayOurs {
		impl = implWatermill
		if err := initWatermillTables(ctx, s.db); err != nil {
			return 0, 0, err
		}
	}
	wr, err := newWriter(ctx, s.db, impl)
	if err != nil {
		return 0, 0, err
	}
	defer wr.close()
	total := max(1, int(float64(rate)*dur.Seconds()))
	var mu sync.Mutex
	committed := make(map[string]time.Time, total)
	received := make(map[string]time.Time, total)

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	snk, err := newSink(sctx, total)
	if err != nil {
		return 0, 0, err
	}
	snk.onMessage = func(m *message.Message, at time.Time) {
		mu.Lock()
		received[m.UUID] = at
		mu.Unlock()
	}
	defer snk.close()
	r, err := startRelay(sctx, s, kind, 1, snk.ch, kind == relayOurs)
	if err != nil {
		return 0, 0, err
	}
	defer r.stop()

	// A steady rate: one transaction per tick, never catching up in bursts.
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for range total {
		<-tick.C
		msgs := newMessages(1, payload)
		if err := wr.writeTx(ctx, msgs); err != nil {
			return 0, 0, err
		}
		now := time.Now()
		mu.Lock()
		committed[msgs[0].UUID] = now
		mu.Unlock()
	}
	select {
	case <-snk.done:
	case <-time.After(30 * time.Second):
		return 0, 0, fmt.Errorf("latency %s: %d of %d messages arrived", kind, snk.count.Load(), total)
	}
	mu.Lock()
	defer mu.Unlock()
	lat := make([]time.Duration, 0, total)
	for id, c := range committed {
		if r, ok := received[id]; ok {
			lat = append(lat, max(0, r.Sub(c)))
		}
	}
	return percentileMS(lat, 50), percentileMS(lat, 99), nil
}

// idleCell runs one relay of kind against an empty outbox for dur and
// returns the transactions per second it cost the database, counted by
// pg_stat_database.xact_commit + xact_rollback of the run's own database
// (pg_stat_statements is not preloaded on this server). With autocommit
// every statement outside an explicit transaction is one transaction, so
// for these relays it is also statements/s, give or take the BEGIN/COMMIT
// pairs watermill-sql wraps around each poll.
func idleCell(ctx context.Context, e *env, kind string, dur time.Duration) (float64, error) {
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return 0, err
	}
	defer s.drop()
	if kind != relayOurs {
		if err := initWatermillTables(ctx, s.db); err != nil {
			return 0, err
		}
	}
	_ = s.db.Close()
	if err := e.waitNoBackends(ctx); err != nil {
		return 0, err
	}
	x0, err := e.xacts(ctx)
	if err != nil {
		return 0, err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	snk, err := newSink(sctx, 1)
	if err != nil {
		return 0, err
	}
	defer snk.close()
	start := time.Now()
	r, err := startRelay(sctx, s, kind, 1, snk.ch, kind == relayOurs)
	if err != nil {
		return 0, err
	}
	select {
	case <-time.After(dur):
	case <-ctx.Done():
	}
	r.stop()
	elapsed := time.Since(start)
	// Backends flush their counters when they exit: wait for all of them.
	if err := e.waitNoBackends(ctx); err != nil {
		return 0, err
	}
	x1, err := e.xacts(ctx)
	if err != nil {
		return 0, err
	}
	return float64(x1-x0) / elapsed.Seconds(), nil
}

// waitNoBackends waits until no session is connected to the bench database,
// so every backend has flushed its statistics.
func (e *env) waitNoBackends(ctx context.Context) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		var n int
		if err := e.admin.QueryRowContext(ctx,
			`SELECT count(*) FROM pg_stat_activity WHERE datname = $1`, e.dbName).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d sessions still connected to %s", n, e.dbName)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
