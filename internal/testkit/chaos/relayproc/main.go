// Command relayproc is the relay process the chaos soak (package
// internal/testkit/chaos) starts, kills, pauses and restarts. It runs one forwarder
// against the outbox (through the soak's fault proxy) and publishes to a
// downstream that records every delivery durably in the soak's tables over
// its own direct connection, and that injects downstream faults: errors
// before accepting, timeouts after accepting (ambiguous), permanent
// rejections (until the soak's operator heals a message and redrives it),
// hangs past the publish timeout, and, while the soak's hang window is on, a
// hang that ignores its context and lasts until the window ends.
//
// It samples its goroutine count all along and records the highest, with
// what its Reports said about abandoned publishes, in chaos_gauge; after
// Run returns (SIGTERM: drain) it prints one line
//
//	relayproc final: goroutines=N heap_inuse=B heap_alloc=B max_goroutines=N
//
// for the soak to check the bounds at the end.
//
// It is a test tool, not a product: the product's relay is `outboxctl relay`.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Statements on the soak's own tables (created by the soak test).
const (
	insertDelivery = `INSERT INTO chaos_delivery (message_id, logical_id, ordering_key, owner, lease_token, outcome)
VALUES ($1, $2, nullif($3, ''), $4, $5, $6)`
	insertStale  = `INSERT INTO chaos_stale (owner, message_id, lease_token) VALUES ($1, $2, $3)`
	insertReport = `INSERT INTO chaos_report (owner, stale, failed_pass, unrecorded, claim_failures, claim_released) VALUES ($1, $2, $3, $4, $5, $6)`
	insertUnwrit = `INSERT INTO chaos_unwritten (owner, message_id, lease_token) VALUES ($1, $2, $3)`
	insertFault  = `INSERT INTO chaos_fault (owner, kind, message_id) VALUES ($1, $2, nullif($3, ''))`
	insertHung   = `INSERT INTO chaos_hung (owner, message_id, lease_token) VALUES ($1, $2, $3)`
	selectHealed = `SELECT EXISTS (SELECT 1 FROM chaos_healed WHERE message_id = $1)`
	// The soak's windows: the broker outage and the hang, each on while its
	// until lies ahead (both read in one statement).
	selectWindows = `SELECT coalesce(extract(epoch FROM (SELECT until FROM chaos_outage) - clock_timestamp()), 0),
       coalesce(extract(epoch FROM (SELECT until FROM chaos_hang) - clock_timestamp()), 0)`
	upsertGauge = `INSERT INTO chaos_gauge (owner, max_goroutines, max_abandoned, paused_passes, claimed_while_paused)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (owner) DO UPDATE SET max_goroutines = EXCLUDED.max_goroutines, max_abandoned = EXCLUDED.max_abandoned,
    paused_passes = EXCLUDED.paused_passes, claimed_while_paused = EXCLUDED.claimed_while_paused`
	rejectedCode   = "CHAOS_REJECTED"
	fateHeader     = "chaos-fate"
	fateReject     = "reject"
	outageError    = "chaos outage: broker unavailable"
	outcomeOK      = "confirmed"
	outcomeAmbig   = "accepted-then-timeout"
	outcomeLate    = "accepted-after-hang"
	insertAttempt  = `INSERT INTO chaos_attempt (owner, message_id, lease_token, ok, code) VALUES ($1, $2, $3, $4, $5)`
	hangFor        = 1200 * time.Millisecond
	recordDeadline = 10 * time.Second
)

func main() {
	// First, before anything can be claimed: a SIGTERM that arrives while the
	// process starts must drain like any other, not kill it. (The soak treats
	// a relay killed by SIGTERM as one that never got here, so held nothing.)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	dsn := flag.String("dsn", "", "outbox database (through the fault proxy)")
	sinkDSN := flag.String("sink-dsn", "", "database for the delivery log (direct)")
	owner := flag.String("owner", "", "lease owner")
	seed := flag.Uint64("seed", 1, "fault seed")
	pErr := flag.Float64("p-error", 0.04, "probability of an error before accepting")
	pAmbig := flag.Float64("p-ambiguous", 0.05, "probability of a timeout after accepting")
	pHang := flag.Float64("p-hang", 0.02, "probability of a hang past the publish timeout")
	noPrefetch := flag.Bool("no-prefetch", false, "DisablePrefetch: claim without pipelining")
	ordering := flag.String("ordering", "block", "OrderingPolicy: block (BlockKey) or skip (SkipParked)")
	maxAbandoned := flag.Int("max-abandoned", 8, "Config.MaxAbandoned")
	flag.Parse()
	policy := fencing.BlockKey
	switch *ordering {
	case "block":
	case "skip":
		policy = fencing.SkipParked
	default:
		fmt.Fprintln(os.Stderr, "relayproc: -ordering must be block or skip")
		os.Exit(2)
	}
	if err := run(ctx, *dsn, *sinkDSN, *owner, *seed, *pErr, *pAmbig, *pHang, *noPrefetch, policy, *maxAbandoned); err != nil {
		fmt.Fprintln(os.Stderr, "relayproc:", err)
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn, sinkDSN, owner string, seed uint64, pErr, pAmbig, pHang float64, noPrefetch bool,
	policy fencing.OrderingPolicy, maxAbandoned int) error {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return err
	}
	db.SetMaxOpenConns(4)
	sinkDB, err := sql.Open("postgres", sinkDSN)
	if err != nil {
		_ = db.Close()
		return err
	}

	sinkDB.SetMaxOpenConns(3)

	ds := &downstream{db: sinkDB, owner: owner, rng: rand.New(rand.NewPCG(seed, seed^0x5eed)),
		pErr: pErr, pAmbig: pAmbig, pHang: pHang}
	g := &gauge{ds: ds, stop: make(chan struct{}), done: make(chan struct{})}
	go g.sample()
	attempts := &attemptLog{ds: ds, ch: make(chan attemptRec, 4096), done: make(chan struct{})}
	go attempts.write()
	logger := &evidenceLogger{LoggerAdapter: watermill.NewStdLogger(false, false), ds: ds}
	cfg := forwarder.Config{
		Owner:             owner,
		BatchSize:         20,
		MaxBatchSize:      80, // claims grow while the relay is behind (issue 14)
		Concurrency:       4,
		LeaseDuration:     2 * time.Second,
		PublishTimeout:    500 * time.Millisecond,
		PollInterval:      50 * time.Millisecond,
		MaxPollInterval:   300 * time.Millisecond,
		BackoffBase:       100 * time.Millisecond,
		BackoffMax:        time.Second,
		MaxAttempts:       25,
		HeartbeatInterval: time.Second,
		BreakerProbeMax:   2 * time.Second,
		DisablePrefetch:   noPrefetch,
		OrderingPolicy:    policy,
		MaxAbandoned:      maxAbandoned,
		TracerProvider:    sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(attempts)),
		OnReport: func(r forwarder.Report) {
			g.report(r)
			if r.Stale > 0 || r.UnrecordedPublishes > 0 || r.ClaimFailures > 0 {
				ds.exec(insertReport, owner, r.Stale, false, r.UnrecordedPublishes, r.ClaimFailures, r.ClaimReleased)
			}
		},
	}
	// A relay started while its database cannot be reached (the soak
	// restarts relays while the proxy is stopped or PostgreSQL restarts)
	// fails in Run before it runs (schema check, first heartbeat), having
	// claimed nothing: it tries again every 200 ms, as a supervisor would
	// restart it. Once running, Run's error is final.
	for {
		var fwd *forwarder.Forwarder
		fwd, err = forwarder.New(db, ds, logger, cfg)
		if err != nil {
			break
		}
		err = fwd.Run(ctx)
		ran := false
		select {
		case <-fwd.Running():
			ran = true
		default:
		}
		if err == nil || ran {
			break
		}
		if ctx.Err() != nil {
			err = nil // told to stop before it could start: it holds nothing
			break
		}
		fmt.Fprintln(os.Stderr, "relayproc: could not start, trying again in 200ms:", err)
		retry := time.NewTimer(200 * time.Millisecond)
		select {
		case <-ctx.Done():
			retry.Stop()
		case <-retry.C:
		}
	}
	// After the drain: the gauge's last word, then everything closed, then
	// what is left of this process (publishes still hanging, if the hang
	// window is on, are in the count).
	close(g.stop)
	<-g.done
	g.flush()
	attempts.close()
	_, _ = db.Close(), sinkDB.Close()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fmt.Printf("relayproc final: goroutines=%d heap_inuse=%d heap_alloc=%d max_goroutines=%d\n",
		runtime.NumGoroutine(), ms.HeapInuse, ms.HeapAlloc, g.maxG.Load())
	return err
}

// attemptLog records how the forwarder itself saw each publish attempt, from
// its publish span as it ends (a span processor): ok (the status is not
// Error: the publish returned nil in time) or the status description (a
// timeout, an error). The downstream may record a delivery as confirmed
// that the relay had already left behind at its PublishTimeout; the soak
// reads this log to know which confirmations the relay saw. Rows go
// through a buffer to a writer goroutine, so the publish path does not
// wait for the sink; a SIGKILL loses the buffer (the soak exempts killed
// relays), a drain flushes it.
type attemptLog struct {
	ds     *downstream
	ch     chan attemptRec
	done   chan struct{}
	mu     sync.RWMutex // held for reading while sending, for writing to close
	closed bool
}

type attemptRec struct {
	id    string
	token int64
	ok    bool
	code  string
}

func (a *attemptLog) OnStart(context.Context, sdktrace.ReadWriteSpan) {}

func (a *attemptLog) OnEnd(s sdktrace.ReadOnlySpan) {
	if !strings.HasPrefix(s.Name(), "outbox.publish ") {
		return
	}
	rec := attemptRec{token: -1, ok: s.Status().Code != codes.Error, code: s.Status().Description}
	for _, kv := range s.Attributes() {
		switch kv.Key {
		case "messaging.message.id":
			rec.id = kv.Value.AsString()
		case "outbox.lease_token":
			rec.token = kv.Value.AsInt64()
		}
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	if !a.closed {
		a.ch <- rec // the writer drains it, so this never waits for close
	}
}

func (a *attemptLog) write() {
	defer close(a.done)
	for rec := range a.ch {
		a.ds.exec(insertAttempt, a.ds.owner, rec.id, rec.token, rec.ok, rec.code)
	}
}

// close flushes the buffer; spans that end later (none after the drain but
// those of publishes still hanging, already ended) are not recorded.
func (a *attemptLog) close() {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return
	}
	a.closed = true
	close(a.ch)
	a.mu.Unlock()
	<-a.done
}

func (a *attemptLog) Shutdown(context.Context) error   { return nil }
func (a *attemptLog) ForceFlush(context.Context) error { return nil }

// gauge keeps the highest goroutine count seen (sampled every 10 ms) and
// what the Reports said about publishes left behind, and writes them to
// chaos_gauge (every 250 ms when changed, and at the end).
type gauge struct {
	ds                         *downstream
	stop, done                 chan struct{}
	maxG, maxAbandoned         atomic.Int64
	paused, claimedWhilePaused atomic.Int64
	mu                         sync.Mutex
	written                    [4]int64
}

func (g *gauge) report(r forwarder.Report) {
	for {
		old := g.maxAbandoned.Load()
		if int64(r.AbandonedPublishes) <= old || g.maxAbandoned.CompareAndSwap(old, int64(r.AbandonedPublishes)) {
			break
		}
	}
	if r.ClaimPaused {
		g.paused.Add(1)
		if r.Claimed > 0 {
			g.claimedWhilePaused.Add(1) // the Report contradicts itself: the soak fails on it
		}
	}
}

func (g *gauge) sample() {
	defer close(g.done)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	last := time.Now()
	for {
		select {
		case <-g.stop:
			return
		case <-tick.C:
		}
		if n := int64(runtime.NumGoroutine()); n > g.maxG.Load() {
			g.maxG.Store(n)
		}
		if time.Since(last) >= 250*time.Millisecond {
			g.flush()
			last = time.Now()
		}
	}
}

func (g *gauge) flush() {
	v := [4]int64{g.maxG.Load(), g.maxAbandoned.Load(), g.paused.Load(), g.claimedWhilePaused.Load()}
	g.mu.Lock()
	defer g.mu.Unlock()
	if v == g.written {
		return
	}
	g.ds.exec(upsertGauge, g.ds.owner, v[0], v[1], v[2], v[3])
	g.written = v
}

// downstream records deliveries and injects faults. The lease token of the
// attempt comes from the forwarder's publish span (attribute
// outbox.lease_token), read through the SDK's ReadOnlySpan.
type downstream struct {
	db                  *sql.DB
	owner               string
	mu                  sync.Mutex
	rng                 *rand.Rand
	pErr, pAmbig, pHang float64

	omu     sync.Mutex
	down    bool      // the outage is on
	hang    bool      // the hang window is on
	checked time.Time // when the windows were last read
}

func (d *downstream) roll() float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rng.Float64()
}

func (d *downstream) exec(q string, args ...any) {
	ctx, cancel := context.WithTimeout(context.Background(), recordDeadline)
	defer cancel()
	if _, err := d.db.ExecContext(ctx, q, args...); err != nil {
		// The evidence is the point of this process: without it the soak
		// cannot judge, so stop loudly.
		fmt.Fprintln(os.Stderr, "relayproc: cannot record evidence:", err)
		os.Exit(3)
	}
}

func (d *downstream) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := d.publishOne(m); err != nil {
			return err
		}
	}
	return nil
}

// windows reports whether the soak's broker outage (chaos_outage) and its
// hang window (chaos_hang) are on, asking the database at most every 50 ms.
func (d *downstream) windows() (outage, hang bool) {
	d.omu.Lock()
	defer d.omu.Unlock()
	if time.Since(d.checked) < 50*time.Millisecond {
		return d.down, d.hang
	}
	var outLeft, hangLeft float64
	if err := d.db.QueryRow(selectWindows).Scan(&outLeft, &hangLeft); err == nil {
		d.down, d.hang, d.checked = outLeft > 0, hangLeft > 0, time.Now()
	}
	return d.down, d.hang
}

func (d *downstream) publishOne(m *message.Message) error {
	outage, hang := d.windows()
	if outage {
		// The broker is gone for everyone: what a client says when it cannot
		// connect (a plain error: the default classifier and the breaker
		// must tell it from a message's own failure).
		return errors.New(outageError)
	}
	token := leaseToken(m)
	if hang {
		// A downstream that hangs on everything and ignores the publish's
		// context: this call does not return while the window is on
		// (however long: the forwarder leaves it behind at its timeout and
		// must bound how many it leaves), then gives up without accepting.
		d.exec(insertHung, d.owner, m.UUID, token)
		d.exec(insertFault, d.owner, "downstream-hang-forever", m.UUID)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, on := d.windows(); !on {
				return errors.New("hung until the downstream recovered (nothing accepted)")
			}
			<-tick.C
		}
	}
	if m.Metadata.Get(fateHeader) == fateReject && !d.healed(m.UUID) {
		d.exec(insertFault, d.owner, "downstream-reject", m.UUID)
		return forwarder.Reject(errors.New("downstream refuses this message for good"), rejectedCode)
	}
	r := d.roll()
	switch {
	case r < d.pErr:
		d.exec(insertFault, d.owner, "downstream-error", "")
		return errors.New("broker unavailable (nothing accepted)")
	case r < d.pErr+d.pHang:
		d.exec(insertFault, d.owner, "downstream-hang", "")
		// Hang past the publish timeout; half of the hangs accept late.
		t := time.NewTimer(hangFor)
		<-t.C
		if d.roll() < 0.5 {
			d.record(m, token, outcomeLate)
		}
		return errors.New("hung")
	}
	if r < d.pErr+d.pHang+d.pAmbig {
		d.record(m, token, outcomeAmbig)
		d.exec(insertFault, d.owner, "downstream-ambiguous", "")
		return errors.New("timeout waiting for the broker's confirm (it may have the message)")
	}
	d.record(m, token, outcomeOK)
	return nil
}

// healed reports whether the soak's operator fixed the downstream for this
// message (before redriving it): a rejection-fated message is then accepted.
func (d *downstream) healed(id string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), recordDeadline)
	defer cancel()
	var ok bool
	if err := d.db.QueryRowContext(ctx, selectHealed, id).Scan(&ok); err != nil {
		fmt.Fprintln(os.Stderr, "relayproc: cannot read chaos_healed:", err)
		os.Exit(3)
	}
	return ok
}

func (d *downstream) record(m *message.Message, token int64, outcome string) {
	var body struct {
		ID string `json:"id"`
	}
	_ = json.Unmarshal(m.Payload, &body)
	d.exec(insertDelivery, m.UUID, body.ID, m.Metadata.Get(envelope.KeyOrderingKey), d.owner, token, outcome)
}

// unwritten records the rows of an outcome statement that failed: their
// confirmed deliveries may not have been written PUBLISHED under their own
// lease, and the forwarder said so (it logs their ids and lease tokens).
func (d *downstream) unwritten(ids []string, tokens []int64) {
	for i, id := range ids {
		d.exec(insertUnwrit, d.owner, id, tokens[i])
	}
	d.exec(insertReport, d.owner, 0, true, 0, 0, 0)
}

func (d *downstream) Close() error { return nil }

func leaseToken(m *message.Message) int64 {
	ro, ok := trace.SpanFromContext(m.Context()).(sdktrace.ReadOnlySpan)
	if !ok {
		return -1
	}
	for _, kv := range ro.Attributes() {
		if kv.Key == attribute.Key("outbox.lease_token") {
			return kv.Value.AsInt64()
		}
	}
	return -1
}

// evidenceLogger records what the forwarder says about stale writes and
// failed passes in the soak's tables, and logs everything to stderr.
type evidenceLogger struct {
	watermill.LoggerAdapter
	ds *downstream
}

func (l *evidenceLogger) Warn(msg string, fields watermill.LogFields) {
	if id, ok := fields["message_id"].(string); ok {
		tok, _ := fields["lease_token"].(int64)
		l.ds.exec(insertStale, l.ds.owner, id, tok)
	}
	l.LoggerAdapter.Info(msg, fields.Add(watermill.LogFields{"severity": "warn"}))
}

func (l *evidenceLogger) Error(msg string, err error, fields watermill.LogFields) {
	ids, _ := fields["message_ids"].([]string)
	tokens, _ := fields["lease_tokens"].([]int64)
	if len(ids) > 0 && len(ids) == len(tokens) {
		l.ds.unwritten(ids, tokens)
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l *evidenceLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &evidenceLogger{LoggerAdapter: l.LoggerAdapter.With(fields), ds: l.ds}
}
