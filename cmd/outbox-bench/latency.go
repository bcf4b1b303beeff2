package main

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// load is a latency cell's steady write load: rate messages per second in
// total for dur, by writers concurrent writers, each message of ours with
// one of keys ordering keys (0: unkeyed).
//
// Without catchUp a writer that misses ticks (its transactions take longer
// than the interval) writes less than the rate. With catchUp every writer
// follows a fixed schedule of messages (rate/writers per second from the
// start) and each transaction writes every message due by then, so two
// relays compared at one load get the same messages per second, in larger
// transactions where the writers are slowed down (by the relay's CPU, or by
// NOTIFY's commit-time lock).
type load struct {
	rate    int
	dur     time.Duration
	writers int
	keys    int
	catchUp bool
}

// maxCatchUp bounds the messages one catch-up transaction writes.
const maxCatchUp = 1000

// maxTxPerWriter bounds one writer's transactions per second: above it, a
// transaction carries several messages (all committed at once) instead.
const maxTxPerWriter = 250

// shape returns the messages per transaction and each writer's interval
// between transactions that make up the load.
func (l load) shape() (perTx int, every time.Duration) {
	w := max(1, l.writers)
	perTx = max(1, (l.rate+w*maxTxPerWriter-1)/(w*maxTxPerWriter))
	txPerWriter := float64(l.rate) / float64(w*perTx)
	return perTx, time.Duration(float64(time.Second) / txPerWriter)
}

// latencyResult is a latency cell's numbers.
type latencyResult struct {
	p50, p99 float64 // ms
	rate     float64 // msg/s actually committed (below the load's when the writers could not keep up)
	late     int     // messages that had not arrived when the wait gave up (their latency counts up to then)
}

// latencyCell writes the load (a ticker per writer, never catching up in
// bursts) and returns p50 and p99 of commit-to-receipt latency in ms: from
// the moment Commit returned to the moment the downstream subscriber got the
// message (zero if the message arrived before Commit returned, which
// LISTEN/NOTIFY makes possible). Ours publishes with NOTIFY and LISTENs.
func latencyCell(ctx context.Context, e *env, kind string, l load, payload []byte) (latencyResult, error) {
	var res latencyResult
	s, err := e.newSchema(ctx, l.writers+2)
	if err != nil {
		return res, err
	}
	defer s.drop()
	impl := implPublisherNotify
	if kind != relayOurs {
		impl = implWatermill
		if err := initWatermillTables(ctx, s.db); err != nil {
			return res, err
		}
	}
	wr, err := newWriter(ctx, s.db, impl)
	if err != nil {
		return res, err
	}
	defer wr.close()
	expect := max(1, int(float64(l.rate)*l.dur.Seconds()))
	var mu sync.Mutex
	committed := make(map[string]time.Time, expect)
	received := make(map[string]time.Time, expect)

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	snk, err := newSink(sctx, math.MaxInt)
	if err != nil {
		return res, err
	}
	snk.onMessage = func(m *message.Message, at time.Time) {
		mu.Lock()
		if _, ok := received[m.UUID]; !ok {
			received[m.UUID] = at
		}
		mu.Unlock()
	}
	defer snk.close()
	r, err := startRelay(sctx, s, kind, 1, snk.ch, kind == relayOurs)
	if err != nil {
		return res, err
	}
	defer r.stop()

	perTx, every := l.shape()
	var wg sync.WaitGroup
	var firstErr error
	var once sync.Once
	start := time.Now()
	deadline := start.Add(l.dur)
	share := float64(l.rate) / float64(max(1, l.writers)) // msg/s per writer
	for w := range max(1, l.writers) {
		wg.Go(func() {
			tick := time.NewTicker(every)
			defer tick.Stop()
			rnd := rand.New(rand.NewPCG(uint64(w), uint64(start.UnixNano())))
			written := 0
			for {
				<-tick.C
				now := time.Now()
				if now.After(deadline) {
					return
				}
				n := perTx
				if l.catchUp {
					if n = min(maxCatchUp, int(share*now.Sub(start).Seconds())-written); n <= 0 {
						continue
					}
				}
				written += n
				msgs := newMessages(n, payload)
				if l.keys > 0 && kind == relayOurs {
					for _, m := range msgs {
						envelope.SetOrderingKey(m, "k"+strconv.Itoa(rnd.IntN(l.keys)))
					}
				}
				if err := wr.writeTx(ctx, msgs); err != nil {
					once.Do(func() { firstErr = err })
					return
				}
				at := time.Now()
				mu.Lock()
				for _, m := range msgs {
					committed[m.UUID] = at
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return res, fmt.Errorf("latency %s: %w", kind, firstErr)
	}
	mu.Lock()
	total := len(committed)
	mu.Unlock()
	res.rate = float64(total) / time.Since(start).Seconds()
	giveUp := time.Now().Add(max(30*time.Second, 2*l.dur))
	for {
		mu.Lock()
		n := len(received)
		mu.Unlock()
		if n >= total || time.Now().After(giveUp) {
			break
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	mu.Lock()
	defer mu.Unlock()
	lat := make([]time.Duration, 0, total)
	now := time.Now()
	for id, c := range committed {
		if r, ok := received[id]; ok {
			lat = append(lat, max(0, r.Sub(c)))
		} else {
			lat = append(lat, now.Sub(c))
			res.late++
		}
	}
	res.p50, res.p99 = percentileMS(lat, 50), percentileMS(lat, 99)
	return res, nil
}

func steadyName(kind, what string) string { return fmt.Sprintf("steady/%s/%s", kind, what) }

// steadyKinds are the relays of the steady-load cells.
var steadyKinds = []string{relayOurs, relayWMTuned}

// runSteady measures end-to-end latency at a steady load of half the
// repetition's unkeyed drain rate (drain/outbox/x1; cfg.SteadyRate when that
// cell did not run), ours over cfg.SteadyKeys ordering keys with NOTIFY,
// beside watermill tuned at the same load.
func runSteady(ctx context.Context, e *env, cfg Config, c *collector, payload []byte, logf func(string, ...any)) error {
	rate := cfg.SteadyRate
	if r, ok := c.by[drainName(relayOurs, 1)]; ok && len(r.Samples) > 0 {
		rate = max(1, int(r.Samples[len(r.Samples)-1]/2))
	}
	l := load{rate: rate, dur: cfg.LatencyDur, writers: cfg.SteadyWriters, keys: cfg.SteadyKeys, catchUp: true}
	for _, k := range steadyKinds {
		res, err := latencyCell(ctx, e, k, l, payload)
		if err != nil {
			return err
		}
		c.add("steady", steadyName(k, "p50"), "ms", res.p50)
		c.add("steady", steadyName(k, "p99"), "ms", res.p99)
		c.add("steady", steadyName(k, "offered"), "msg/s", float64(rate))
		c.add("steady", steadyName(k, "committed"), "msg/s", res.rate)
		c.add("steady", steadyName(k, "late"), "msgs", float64(res.late))
		logf("  %-28s at %d msg/s offered (%.0f committed): p50 %.1f ms p99 %.1f ms, %d late", "steady/"+k, rate, res.rate, res.p50, res.p99, res.late)
	}
	return nil
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
	ours := kind == relayOurs || kind == relayOursLanes
	switch {
	case kind == relayOursLanes:
		if err := fencing.SetLaneCount(ctx, s.db, 32, forwarder.DefaultMaxAttempts); err != nil {
			return 0, err
		}
	case !ours:
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
	r, err := startRelay(sctx, s, kind, 1, snk.ch, ours)
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
