package forwarder

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// Codes returned by the forwarder (configuration refusals use
// OUTBOX_INVALID_CONFIG and OUTBOX_LEASE_TOO_SHORT; a CDC database refuses
// Run with debezium's RELAY_MODE_CONFLICT).
const (
	CodeClosed         outbox.Code = "FORWARDER_CLOSED"          // Run after Close
	CodeAlreadyRunning outbox.Code = "FORWARDER_ALREADY_RUNNING" // Run twice
	CodeUnknownOutcome outbox.Code = "FORWARDER_UNKNOWN_OUTCOME" // a classifier returned an Outcome the forwarder does not know
	// CodeHeartbeatLapsed: a pass of Run claimed nothing because no heartbeat
	// succeeded within the heartbeat's lifetime; the loop goes on and claims
	// again after the next successful heartbeat.
	CodeHeartbeatLapsed outbox.Code = "FORWARDER_HEARTBEAT_LAPSED"
)

// Sentinels for errors.Is.
var (
	ErrClosed          = &outbox.Error{Code: CodeClosed}
	ErrAlreadyRunning  = &outbox.Error{Code: CodeAlreadyRunning}
	ErrUnknownOutcome  = &outbox.Error{Code: CodeUnknownOutcome}
	ErrHeartbeatLapsed = &outbox.Error{Code: CodeHeartbeatLapsed}
)

const tracerName = "github.com/fencedoutbox/watermill-outbox/forwarder"

// defaultDBTimeout bounds each of the forwarder's own statements (the claim,
// the outcome batch), each on its own context: a pass may publish for up to
// LeaseDuration - 1.5 x PublishTimeout between them. They run on a context
// that stopping does not cancel: a claim cancelled half way could leave rows
// claimed but never published until their lease expires.
const defaultDBTimeout = 15 * time.Second

// Report counts what one pass did. Stale rows are possible duplicate
// publications: this relay's lease was gone when it wrote the outcome.
type Report struct {
	Claimed   int // rows the claim returned (including rows it parked)
	Published int
	Ambiguous int
	Failed    int
	Exhausted int // parked by this pass, or by the claim (expired lease, budget spent)
	Stale     int
	Released  int // claimed but not attempted (stopping, lease too short to start)
	Duration  time.Duration
}

// Forwarder is the fenced relay: it moves committed outbox rows to a
// watermill publisher. Create it with New, run it with Run (or a Router via
// RouterPlugin), stop it with Close.
type Forwarder struct {
	db     *sql.DB
	q      fencing.DBTX // db, or its prepared form for the claim and outcome statements
	out    message.Publisher
	logger watermill.LoggerAdapter
	cfg    Config

	baseLogger watermill.LoggerAdapter // as given, for the optional Warner
	tracer     trace.Tracer
	metrics    *metrics
	seed       uint64 // from the owner: per-relay jitter, deterministic per owner
	dbTimeout  time.Duration
	start      claimStart // where each claim starts in the claimable index

	// Claims of Run wait for a fresh heartbeat: once it has lapsed,
	// debezium.Enable may switch the database to CDC, and a relay still
	// claiming would race the connector. lastBeat is when the last successful
	// Beat was sent (time since beatEpoch, monotonic; the database's
	// expires_at counts from later); beatTTL is zero outside Run (no gate).
	beatEpoch time.Time
	lastBeat  atomic.Int64
	beatTTL   atomic.Int64

	mu      sync.Mutex
	started bool
	closed  bool

	stop     chan struct{}
	stopOnce sync.Once
	running  chan struct{}
	done     chan struct{}
}

// New builds a forwarder. It refuses a nil database or publisher and any
// configuration Validate refuses; with cfg.Metrics set it registers its
// collectors there.
func New(db *sql.DB, out message.Publisher, logger watermill.LoggerAdapter, cfg Config) (*Forwarder, error) {
	const op = "forwarder.New"
	if db == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, "db must not be nil")
	}
	if out == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, "downstream publisher must not be nil")
	}
	cfg, err := cfg.validated()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	m, err := newMetrics(cfg.Metrics, cfg.BatchSize)
	if err != nil {
		return nil, outbox.Wrap(outbox.CodeInvalidConfig, op, err, "register metrics")
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	var q fencing.DBTX = db
	if !cfg.DisablePreparedStatements {
		q = fencing.NewPrepared(db)
	}
	return &Forwarder{
		db: db, q: q, out: out, cfg: cfg, metrics: m,
		logger:     logger.With(watermill.LogFields{"owner": cfg.Owner}),
		baseLogger: logger,
		tracer:     tp.Tracer(tracerName),
		seed:       seedOf(cfg.Owner),
		dbTimeout:  defaultDBTimeout,
		beatEpoch:  time.Now(),
		stop:       make(chan struct{}),
		running:    make(chan struct{}),
		done:       make(chan struct{}),
	}, nil
}

// Owner is the lease owner this forwarder writes.
func (f *Forwarder) Owner() string { return f.cfg.Owner }

// Config returns the configuration with defaults filled in.
func (f *Forwarder) Config() Config { return f.cfg }

// Running is closed once Run has passed its start-up checks and polls.
func (f *Forwarder) Running() chan struct{} { return f.running }

// Close stops the loop and waits for Run to return. The pass in progress is
// drained: publishes already started get up to DrainTimeout to finish,
// rows not yet started are released, and every outcome is written, so no
// row is left IN_FLIGHT under this relay's name — unless that last write
// fails (database gone), which Run returns. Safe to call twice, or
// before Run (Run then returns FORWARDER_CLOSED).
func (f *Forwarder) Close() error {
	f.mu.Lock()
	f.closed = true
	started := f.started
	f.mu.Unlock()
	f.stopOnce.Do(func() { close(f.stop) })
	if started {
		<-f.done
	}
	if p, ok := f.q.(*fencing.Prepared); ok {
		// Releases the statements on the pool's connections; a RunOnce
		// after Close still works, unprepared.
		_ = p.Close()
	}
	return nil
}

// Run relays until ctx is cancelled or Close is called; both drain the pass
// in progress. It refuses to start with RELAY_MODE_CONFLICT when the database
// records CDC mode, and stops with that error if a heartbeat finds the mode
// switched. A failing pass is logged and counted and the loop goes on. If
// the last pass on the way out (releasing a batch claimed ahead) fails, Run
// returns that error too: those rows stay IN_FLIGHT until their leases
// expire.
func (f *Forwarder) Run(ctx context.Context) (err error) {
	f.mu.Lock()
	switch {
	case f.closed:
		f.mu.Unlock()
		return outbox.Errorf(CodeClosed, "forwarder.Run", "the forwarder was closed; create a new one")
	case f.started:
		f.mu.Unlock()
		return outbox.Errorf(CodeAlreadyRunning, "forwarder.Run", "Run was already called on this forwarder")
	}
	f.started = true
	f.mu.Unlock()
	defer close(f.done)

	ttl := 3 * f.cfg.HeartbeatInterval
	sent := time.Since(f.beatEpoch)
	if err := debezium.Beat(ctx, f.db, f.cfg.Owner, ttl); err != nil {
		return err
	}
	f.lastBeat.Store(int64(sent))
	f.beatTTL.Store(int64(ttl))
	defer f.beatTTL.Store(0)
	defer func() {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
		defer cancel()
		if err := debezium.Leave(lctx, f.db, f.cfg.Owner); err != nil {
			f.logger.Error("Relay heartbeat not removed", err, nil)
		}
	}()

	// Background goroutines stop before the heartbeat is removed (the defer
	// above runs last), so a late beat cannot resurrect it.
	exit := make(chan struct{})
	var bg sync.WaitGroup
	defer func() {
		close(exit)
		bg.Wait()
	}()
	stopping, drainExpired := f.stopSignals(ctx, exit)

	// Heartbeat: a CDC switch made while this relay's heartbeat lapsed is
	// fatal, anything else (database briefly down) is logged.
	fatal := make(chan error, 1)
	bg.Add(1)
	go func() {
		defer bg.Done()
		t := time.NewTicker(f.cfg.HeartbeatInterval)
		defer t.Stop()
		for {
			select {
			case <-stopping:
				return
			case <-t.C:
				hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.cfg.HeartbeatInterval)
				sent := time.Since(f.beatEpoch)
				err := debezium.Beat(hctx, f.db, f.cfg.Owner, ttl)
				cancel()
				if err == nil {
					f.lastBeat.Store(int64(sent))
				}
				if errors.Is(err, debezium.ErrRelayModeConflict) {
					fatal <- err
					return
				}
				if err != nil {
					f.logger.Error("Relay heartbeat failed; claims stop once it has failed for longer than its lifetime", err, watermill.LogFields{"ttl": ttl})
				}
			}
		}
	}()

	wake := f.listen(stopping, &bg)
	close(f.running)
	f.logger.Info("Outbox forwarder running", watermill.LogFields{
		"batch_size": f.cfg.BatchSize, "concurrency": f.cfg.Concurrency, "ordering_policy": f.cfg.OrderingPolicy.String(),
		"listen": f.cfg.ListenURL != "",
	})

	// next is the batch claimed ahead while the previous one was being
	// published, and behind is the previous pass's outcome write, still
	// running while next is published (see pass; both off with
	// DisablePrefetch). Every way out of the loop hands them to one more pass,
	// which sees stopping closed and releases next's rows, so no row is left
	// IN_FLIGHT under this relay's name and every outcome is written before
	// Run returns.
	var next <-chan claimedBatch
	var behind *tail
	defer func() {
		if next == nil {
			return
		}
		<-stopping
		t, _ := f.pass(ctx, stopping, drainExpired, next, false, behind)
		if _, berr := behind.wait(); berr != nil {
			berr = fmt.Errorf("forwarder: the last pass before stopping: %w", berr)
			f.logger.Error("Outbox pass failed; rows whose outcome was not written stay IN_FLIGHT until their leases expire", berr, nil)
			err = errors.Join(err, berr)
		}
		if _, rerr := t.wait(); rerr != nil {
			rerr = fmt.Errorf("forwarder: release the batch claimed ahead: %w", rerr)
			f.logger.Error("Outbox final release failed; its rows stay IN_FLIGHT until their leases expire", rerr, nil)
			err = errors.Join(err, rerr)
		}
	}()
	var idle, failures int
	for {
		cur, pre := f.pass(ctx, stopping, drainExpired, next, !f.cfg.DisablePrefetch, behind)
		var err error
		if behind != nil {
			_, err = behind.wait() // finished: pass waits for it before writing its own outcomes
		}
		next, behind = pre, nil
		claimed := cur.rep.Claimed
		if pre != nil {
			behind = cur // its outcomes are written while the batch claimed ahead is published
		} else {
			_, terr := cur.wait() // finished: without a batch claimed ahead, pass waits for its own outcomes
			err = errors.Join(err, terr)
		}
		var delay time.Duration
		switch {
		case err != nil:
			failures++
			idle = 0
			delay = f.jittered(f.cfg.BackoffBase, f.cfg.BackoffMax, failures, 0)
			f.logger.Error("Outbox pass failed", err, watermill.LogFields{"consecutive_failures": failures, "retry_in": delay})
		case claimed >= f.cfg.BatchSize:
			failures, idle = 0, 0 // a full batch: more is waiting, go again at once
		case claimed > 0:
			failures, idle = 0, 0
			delay = f.cfg.PollInterval
		default:
			failures = 0
			idle++
			delay = f.jittered(f.cfg.PollInterval, f.cfg.MaxPollInterval, idle, 1)
		}
		if f.stopRequested(ctx, stopping) {
			f.logger.Info("Outbox forwarder stopped", nil)
			return nil
		}
		select {
		case err := <-fatal:
			f.stopOnce.Do(func() { close(f.stop) })
			return err
		default:
		}
		if delay == 0 {
			continue
		}
		t := time.NewTimer(delay)
		select {
		case <-stopping:
			t.Stop()
			f.logger.Info("Outbox forwarder stopped", nil)
			return nil
		case err := <-fatal:
			t.Stop()
			f.stopOnce.Do(func() { close(f.stop) })
			return err
		case <-wake:
			t.Stop()
			idle = 0
		case <-t.C:
		}
	}
}

// stopRequested reports whether ctx was cancelled or Close called. It reads
// them directly as well as stopping, which another goroutine closes a moment
// after them: a pass started in that moment would take the batch claimed
// ahead as an ordinary pass instead of the final one that releases it.
func (f *Forwarder) stopRequested(ctx context.Context, stopping <-chan struct{}) bool {
	select {
	case <-stopping:
	case <-ctx.Done():
	case <-f.stop:
	default:
		return false
	}
	return true
}

// stopSignals returns a channel closed when ctx is cancelled or Close is
// called, and one closed DrainTimeout after that.
func (f *Forwarder) stopSignals(ctx context.Context, exit <-chan struct{}) (stopping, drainExpired chan struct{}) {
	stopping, drainExpired = make(chan struct{}), make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-f.stop:
		case <-exit:
		}
		close(stopping)
		t := time.NewTimer(f.cfg.DrainTimeout)
		defer t.Stop()
		select {
		case <-t.C:
		case <-exit:
		}
		close(drainExpired)
	}()
	return stopping, drainExpired
}

// listen starts the configured Listener (listen.go) on Config.NotifyChannel
// and returns a channel that receives a value per wake-up (nil channel when
// none is configured). Nothing here blocks the caller; the listener runs in
// the background until stopping is closed. Polling carries the load meanwhile.
func (f *Forwarder) listen(stopping <-chan struct{}, bg *sync.WaitGroup) <-chan struct{} {
	return startListening(f.cfg, f.logger, stopping, bg)
}

// RunOnce runs one pass: claim a batch, publish it, write the outcomes. It
// does not check the relay mode or send heartbeats (Run does); tools and
// tests use it. Cancelling ctx drains the pass like Close does.
func (f *Forwarder) RunOnce(ctx context.Context) (Report, error) {
	stopping, drainExpired := make(chan struct{}), make(chan struct{})
	exit := make(chan struct{})
	defer close(exit)
	go func() {
		select {
		case <-ctx.Done():
		case <-exit:
			return
		}
		close(stopping)
		t := time.NewTimer(f.cfg.DrainTimeout)
		defer t.Stop()
		select {
		case <-t.C:
			close(drainExpired)
		case <-exit:
		}
	}()
	t, _ := f.pass(ctx, stopping, drainExpired, nil, false, nil)
	return t.wait()
}

// dbNow is the clock passed to SQL: zero (server time) unless injected.
func (f *Forwarder) dbNow() time.Time {
	if f.cfg.Now != nil {
		return f.cfg.Now()
	}
	return time.Time{}
}

func (f *Forwarder) localNow() time.Time {
	if f.cfg.Now != nil {
		return f.cfg.Now()
	}
	return time.Now()
}

// item is one claimed row on its way through a pass.
type item struct {
	claimed fencing.Claimed
	msg     *message.Message
	outcome fencing.Outcome
	err     error // the publish error, for the log
	unknown bool  // classifier returned an unknown Outcome
}

// verdict names what happened to the row, for logs and metrics: derived from
// the outcome to be written (or, for a row the claim parked, from that).
func (it *item) verdict() string {
	if !it.claimed.Held() {
		return "exhausted" // parked by the claim
	}
	switch it.outcome.To {
	case envelope.StatusPublished:
		return "published"
	case envelope.StatusAmbiguous:
		return "ambiguous"
	case envelope.StatusFailed:
		return "failed"
	case envelope.StatusExhausted:
		return "exhausted"
	case envelope.StatusPending:
		return "released"
	}
	return "unknown"
}

// claimedBatch is the result of one claim and the local time just before
// it, which is where its rows' start-by deadline is measured from.
type claimedBatch struct {
	claimed   []fencing.Claimed
	claimedAt time.Time
	err       error
}

func (f *Forwarder) claim(ctx context.Context) claimedBatch {
	if ttl := time.Duration(f.beatTTL.Load()); ttl > 0 {
		if age := time.Since(f.beatEpoch) - time.Duration(f.lastBeat.Load()); age > ttl {
			return claimedBatch{err: outbox.Errorf(CodeHeartbeatLapsed, "forwarder.claim",
				"no relay heartbeat succeeded for %s, longer than its lifetime %s: the database may have been switched to CDC meanwhile, so nothing is claimed until a heartbeat succeeds again (check the database connection)",
				age.Round(time.Millisecond), ttl)}
		}
	}
	dbctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
	defer cancel()
	at := f.localNow()
	p := fencing.ClaimParams{
		Owner: f.cfg.Owner, Limit: f.cfg.BatchSize, Lease: f.cfg.LeaseDuration,
		MaxAttempts: f.cfg.MaxAttempts, Policy: f.cfg.OrderingPolicy, Now: f.dbNow(),
		FromSeq: f.start.from(),
	}
	claimed, err := fencing.Claim(dbctx, f.q, p)
	if err == nil && p.FromSeq > 0 && len(claimed) < p.Limit {
		// Nothing more at or above the start point: look below it before
		// calling the batch short, so that a short batch (which sends Run
		// to idle) always means the whole claimable index had no more. The
		// rows claimed above are IN_FLIGHT under this relay now, so this
		// claim cannot take them again.
		below := p
		below.Limit, below.FromSeq = p.Limit-len(claimed), 0
		more, berr := fencing.Claim(dbctx, f.q, below)
		if berr != nil {
			// The rows claimed above the start are held and go on; record
			// makes the next claim start at the first entry.
			f.logger.Error("Outbox claim below the start point failed", berr, watermill.LogFields{"held": len(claimed)})
		}
		claimed = append(more, claimed...)
		slices.SortFunc(claimed, func(a, b fencing.Claimed) int { return cmp.Compare(a.Row.Seq, b.Row.Seq) })
		f.start.record(0, p.Limit, claimed, berr) // this batch looked at the whole index
		return claimedBatch{claimed: claimed, claimedAt: at}
	}
	f.start.record(p.FromSeq, p.Limit, claimed, err)
	return claimedBatch{claimed: claimed, claimedAt: at, err: err}
}

// tail is the second half of a pass: writing its outcomes and reporting.
// Under Run it may still be running while the next pass publishes.
type tail struct {
	start time.Time
	rep   Report // rep.Claimed is set before the tail can run behind: the loop reads it
	err   error
	done  chan struct{} // closed once rep and err are final
}

// wait returns the pass's report once its outcomes are written (at once for
// a nil tail).
func (t *tail) wait() (Report, error) {
	if t == nil {
		return Report{}, nil
	}
	<-t.done
	return t.rep, t.err
}

// end finishes a pass: metrics, OnReport, then the waiters.
func (f *Forwarder) end(t *tail, err error) {
	t.rep.Duration = time.Since(t.start)
	t.err = err
	f.metrics.pass(t.rep.Claimed, err != nil)
	if f.cfg.OnReport != nil {
		f.cfg.OnReport(t.rep)
	}
	close(t.done)
}

// pass claims a batch (or takes the one claimed ahead, pre), publishes it
// and writes its outcomes. A pass given pre always consumes it, also when
// stopping (its rows are then released, not published).
//
// With prefetch set and a full batch claimed, it pipelines: it starts
// claiming the next batch on another connection right away and returns it
// as next, and it returns before its outcomes are written, so the caller
// publishes next while this pass's outcome statement runs (the returned
// tail; the caller hands it to the next pass as behind). Outcome statements
// still run one at a time and in pass order: a pass waits for behind before
// writing its own. Neither can reorder a key: a batch's rows stay
// IN_FLIGHT (not PUBLISHED) until its outcome statement commits, and while
// they do the claim returns no later row of their keys. Nor does it change
// what a crash leaves: outcomes are written as soon as the batch's publishes
// end, exactly as without pipelining; what no longer waits for them is the
// next batch's publishing.
//
// Without a batch claimed ahead (next nil) the returned tail is finished.
func (f *Forwarder) pass(ctx context.Context, stopping, drainExpired <-chan struct{}, pre <-chan claimedBatch, prefetch bool, behind *tail) (t *tail, next <-chan claimedBatch) {
	t = &tail{start: time.Now(), done: make(chan struct{})}
	var b claimedBatch
	if pre != nil {
		b = <-pre
	} else {
		select {
		case <-stopping:
			behind.wait()
			f.end(t, nil)
			return t, nil
		default:
		}
		b = f.claim(ctx)
	}
	claimed := b.claimed
	if b.err != nil || len(claimed) == 0 {
		behind.wait()
		f.end(t, b.err)
		return t, nil
	}
	t.rep.Claimed = len(claimed)
	if prefetch && len(claimed) >= f.cfg.BatchSize {
		select {
		case <-stopping:
		default:
			ch := make(chan claimedBatch, 1) // buffered: the claim never waits for its reader
			go func() { ch <- f.claim(ctx) }()
			next = ch
		}
	}
	// No publish starts unless it can end (PublishTimeout) and its outcome
	// be written (a margin of half a PublishTimeout) before the lease
	// expires; measured on the local clock from just before this batch's own
	// claim (a prefetched batch waited for the previous pass meanwhile), so
	// clock skew with the database cannot stretch it.
	startBy := b.claimedAt.Add(f.cfg.LeaseDuration - f.cfg.PublishTimeout - f.cfg.PublishTimeout/2)

	items := make([]item, len(claimed)) // one allocation for the batch
	work := make([]*item, 0, len(claimed))
	for i, c := range claimed {
		it := &items[i]
		it.claimed = c
		switch {
		case !c.Held():
			// Parked by the claim: an expired lease spent the budget
			// (LEASE_EXPIRED), or the budget was already spent (BUDGET_SPENT).
			f.logger.Error("Outbox row exhausted by the claim", nil, watermill.LogFields{
				"message_id": c.Row.MessageID, "destination": c.Row.Destination, "attempts": c.Row.Attempts,
				"code": c.Row.LastFailureCode,
			})
		case c.Err != nil:
			f.park(it, c.Err)
		default:
			msg, err := envelope.ToMessage(c.Row, envelope.Options{Producer: f.cfg.Producer})
			if err != nil {
				f.park(it, err)
				continue
			}
			it.msg = msg
			work = append(work, it)
		}
	}

	f.publishAll(work, startBy, stopping, drainExpired)

	behind.wait()
	if next == nil {
		f.writeOutcomes(ctx, t, items)
		return t, nil
	}
	go f.writeOutcomes(ctx, t, items)
	return t, next
}

// writeOutcomes writes the outcomes of a pass's items, logs and counts them,
// and ends the pass.
func (f *Forwarder) writeOutcomes(ctx context.Context, t *tail, items []item) {
	outcomes := make([]fencing.Outcome, 0, len(items))
	written := make([]*item, 0, len(items))
	now := f.dbNow() // one clock for the batch: Apply writes it as one instant
	for i := range items {
		it := &items[i]
		if it.claimed.Held() {
			it.outcome.Lease = it.claimed.Lease
			it.outcome.Now = now
			outcomes = append(outcomes, it.outcome)
			written = append(written, it)
		}
	}
	// The outcome write gets its own timeout, started now: the publishes
	// may have taken longer than dbTimeout, and an outcome written on an
	// expired context would be lost (the rows would be published again
	// after their leases expire, until EXHAUSTED).
	dbctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
	defer cancel()
	results, err := f.apply(dbctx, outcomes)
	if err != nil {
		ids, tokens := make([]string, len(outcomes)), make([]int64, len(outcomes))
		for i, o := range outcomes {
			ids[i], tokens[i] = o.Lease.MessageID, o.Lease.Token
		}
		f.logger.Error("Outbox outcomes not written: these rows stay IN_FLIGHT until their leases expire and are then claimed again, so those already published may be published twice", err, watermill.LogFields{
			"rows": len(outcomes), "message_ids": ids, "lease_tokens": tokens,
		})
		f.end(t, fmt.Errorf("forwarder: write outcomes of %d rows: %w", len(outcomes), err))
		return
	}
	var stale map[*item]bool
	for i, r := range results {
		if r == fencing.Stale {
			if stale == nil {
				stale = make(map[*item]bool)
			}
			stale[written[i]] = true
		}
	}
	rep := &t.rep
	var unknown error
	for i := range items {
		it := &items[i]
		row := it.claimed.Row
		verdict := it.verdict()
		if stale[it] {
			rep.Stale++
			f.metrics.message("stale", row.Destination)
			f.warn("Outbox lease lost before the outcome was written: possible duplicate publication", watermill.LogFields{
				"message_id": row.MessageID, "owner": it.claimed.Lease.Owner,
				"lease_token": it.claimed.Lease.Token, "destination": row.Destination, "outcome": verdict,
			})
			continue
		}
		switch verdict {
		case "published":
			rep.Published++
		case "ambiguous":
			rep.Ambiguous++
		case "failed":
			rep.Failed++
		case "exhausted":
			rep.Exhausted++
		case "released":
			rep.Released++
		}
		f.metrics.message(verdict, row.Destination)
		if it.unknown && unknown == nil {
			unknown = outbox.Errorf(CodeUnknownOutcome, "forwarder.pass",
				"the classifier returned an unknown outcome for row %s; it was recorded as AMBIGUOUS; fix the classifier to return Confirmed, Rejected or Ambiguous", row.MessageID)
		}
		if verdict == "ambiguous" || verdict == "failed" || (verdict == "exhausted" && it.claimed.Held()) {
			f.logger.Info("Outbox publish not confirmed", watermill.LogFields{
				"message_id": row.MessageID, "destination": row.Destination, "outcome": verdict,
				"code": it.outcome.Code, "attempt": row.Attempts + 1, "lease_token": it.claimed.Lease.Token,
				"retry_in": it.outcome.RetryAfter, "error": fmt.Sprint(it.err),
			})
		}
	}
	f.end(t, unknown)
}

// apply writes the outcomes, trying again twice on a database error: the
// rows were published already, and an outcome lost now means the row is
// published again after its lease expires. The statement is atomic, so a
// retry never applies half a batch twice. (If the first try committed but its
// answer was lost, the retry reports the rows stale: a false alarm on the
// safe side.)
func (f *Forwarder) apply(ctx context.Context, outcomes []fencing.Outcome) ([]fencing.Result, error) {
	var err error
	for try := range 3 {
		var res []fencing.Result
		if res, err = fencing.Apply(ctx, f.q, outcomes); err == nil || errors.Is(err, fencing.ErrInvalidArgument) {
			return res, err
		}
		f.logger.Error("Writing outcomes failed", err, watermill.LogFields{"try": try + 1, "rows": len(outcomes)})
		t := time.NewTimer(time.Duration(try+1) * 100 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
	}
	return nil, err
}

// Warner is implemented by loggers that have a warning level; watermill's
// LoggerAdapter has none, so warnings go to Info with severity=warn
// otherwise.
type Warner interface {
	Warn(msg string, fields watermill.LogFields)
}

func (f *Forwarder) warn(msg string, fields watermill.LogFields) {
	fields = watermill.LogFields{"owner": f.cfg.Owner}.Add(fields)
	if w, ok := f.baseLogger.(Warner); ok {
		w.Warn(msg, fields)
		return
	}
	f.logger.Info(msg, fields.Add(watermill.LogFields{"severity": "warn"}))
}

// park records a row that cannot become a message (corrupt headers, a
// reserved header name) as FAILED: retrying would fail the same way forever.
func (f *Forwarder) park(it *item, err error) {
	code := string(outbox.CodeOf(err))
	if code == "" {
		code = string(outbox.CodeCorruptRow)
	}
	it.err = err
	it.outcome = fencing.Outcome{To: envelope.StatusFailed, Code: code, Detail: err.Error()}
}

// publishAll publishes work, up to Concurrency messages at once, starting
// them in the order of work.
func (f *Forwarder) publishAll(work []*item, startBy time.Time, stopping, drainExpired <-chan struct{}) {
	var taken atomic.Int64
	var wg sync.WaitGroup
	for range min(f.cfg.Concurrency, len(work)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &runner{out: f.out}
			defer r.stop()
			for i := taken.Add(1) - 1; i < int64(len(work)); i = taken.Add(1) - 1 {
				f.handle(r, work[i], startBy, stopping, drainExpired)
			}
		}()
	}
	wg.Wait()
}

// runner runs one worker's publishes on a goroutine of its own, so that a
// publish which overruns its time can be left behind while the worker goes
// on. The goroutine is kept for all the worker's messages (one per message
// would start, and grow a stack, for every one); after leaving one behind,
// the next publish starts a new one.
type runner struct {
	out  message.Publisher
	jobs chan publishJob // nil: no goroutine yet, or the last one was left behind
	done chan error      // buffered: a goroutine left behind never blocks on its answer
}

type publishJob struct {
	topic string
	msg   *message.Message
}

// publish hands msg to the runner's goroutine and waits for its answer, for
// ctx to end, or for drainExpired. It returns the publisher's error (a
// panic turned into a *panicError), or errLeftBehind or errDrainExpired
// when it left the publish behind.
func (r *runner) publish(ctx context.Context, topic string, msg *message.Message, drainExpired <-chan struct{}) error {
	if r.jobs == nil {
		jobs, done, out := make(chan publishJob), make(chan error, 1), r.out
		go func() {
			for j := range jobs {
				done <- publishRecovering(out, j)
			}
		}()
		r.jobs, r.done = jobs, done
	}
	r.jobs <- publishJob{topic: topic, msg: msg} // the goroutine is idle: it takes the job at once
	select {
	case err := <-r.done:
		return err
	case <-ctx.Done():
		r.stop()
		return errLeftBehind
	case <-drainExpired:
		r.stop()
		return errDrainExpired
	}
}

var (
	errLeftBehind   = errors.New("publish left running when its context ended")
	errDrainExpired = errors.New("publish still running when the drain deadline passed")
)

// stop lets the runner's goroutine end once its current publish (if any)
// returns.
func (r *runner) stop() {
	if r.jobs != nil {
		close(r.jobs)
		r.jobs = nil
	}
}

// publishRecovering is out.Publish with a panic turned into an error.
func publishRecovering(out message.Publisher, j publishJob) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v}
		}
	}()
	return out.Publish(j.topic, j.msg)
}

// handle publishes one item on r and sets its outcome.
func (f *Forwarder) handle(r *runner, it *item, startBy time.Time, stopping, drainExpired <-chan struct{}) {
	row := it.claimed.Row
	select {
	case <-stopping:
		it.outcome = fencing.Outcome{To: envelope.StatusPending}
		return
	default:
	}
	if f.localNow().After(startBy) {
		it.outcome = fencing.Outcome{To: envelope.StatusPending}
		return
	}
	attempt := row.Attempts + 1
	err, code := f.publish(r, it.msg, row, attempt, drainExpired)
	it.err = err
	var v Verdict
	switch {
	case code != "":
		v = Verdict{Outcome: Ambiguous, Code: code}
	case err == nil:
		v = Verdict{Outcome: Confirmed}
	default:
		v = f.cfg.Classifier(err)
	}
	switch v.Outcome {
	case Confirmed:
		it.outcome = fencing.Outcome{To: envelope.StatusPublished}
		return
	case Rejected:
		it.outcome = fencing.Outcome{To: envelope.StatusFailed, Code: cmpOr(v.Code, FailurePublishRejected), Detail: errText(err)}
		return
	case Ambiguous:
		v.Code = cmpOr(v.Code, FailurePublishError)
	default:
		// Loud, but never silent: the row is written AMBIGUOUS (the safe
		// reading of "we do not know") and the pass reports the error.
		it.unknown = true
		v.Code = FailureUnknownOutcome
	}
	if attempt >= f.cfg.MaxAttempts {
		it.outcome = fencing.Outcome{To: envelope.StatusExhausted, Code: v.Code, Detail: errText(err)}
		return
	}
	// The delay, not a local deadline: the outcome statement adds it to the
	// clock the claim compares with (Config.Now, or the database's now()),
	// so host clock skew neither removes nor stretches the backoff.
	it.outcome = fencing.Outcome{
		To: envelope.StatusAmbiguous, Code: v.Code, Detail: errText(err),
		RetryAfter: f.RetryDelay(row.MessageID, attempt),
	}
}

// publish sends msg downstream on r under a span continuing the row's
// trace. It returns the publisher's error, or a failure code when the
// publish timed out (PublishTimeout, or the drain deadline) or panicked.
func (f *Forwarder) publish(r *runner, msg *message.Message, row envelope.Row, attempt int, drainExpired <-chan struct{}) (error, string) {
	ctx, span := f.tracer.Start(msg.Context(), "outbox.publish "+row.Destination, trace.WithSpanKind(trace.SpanKindProducer))
	defer span.End()
	if span.IsRecording() { // built only for a span that keeps them: this runs once per message
		span.SetAttributes(
			attribute.String("messaging.message.id", row.MessageID),
			attribute.String("messaging.destination.name", row.Destination),
			attribute.Int("outbox.attempt", attempt),
			attribute.Int64("outbox.lease_token", row.LeaseToken),
		)
	}
	ctx, cancel := context.WithTimeout(ctx, f.cfg.PublishTimeout)
	defer cancel()
	msg.SetContext(ctx)

	began := time.Now()
	err := r.publish(ctx, row.Destination, msg, drainExpired)
	var code string
	var pe *panicError
	switch {
	case err == nil:
	case errors.As(err, &pe):
		code = FailurePublishPanic
	case errors.Is(err, errDrainExpired):
		code = FailurePublishTimeout
	case errors.Is(err, errLeftBehind):
		err, code = fmt.Errorf("publish did not return within %s", f.cfg.PublishTimeout), FailurePublishTimeout
	}
	f.metrics.published(row.Destination, time.Since(began))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, cmpOr(code, "publish failed"))
	}
	return err, code
}

type panicError struct{ value any }

func (p *panicError) Error() string { return fmt.Sprintf("downstream publisher panicked: %v", p.value) }

// RetryDelay is the wait before attempt+1 of a row whose attempt-th attempt
// was ambiguous: BackoffBase x 2^(attempt-1), capped at BackoffMax, with
// "equal jitter" (between half and all of it). The jitter is a hash of this
// relay's owner, the message id and the attempt: replicas spread their
// retries differently, and a given owner always computes the same delay.
func (f *Forwarder) RetryDelay(messageID string, attempt int) time.Duration {
	h := fnv.New64a()
	_, _ = h.Write([]byte(f.cfg.Owner))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(messageID))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(strconv.Itoa(attempt)))
	return spread(exp(f.cfg.BackoffBase, f.cfg.BackoffMax, attempt), h.Sum64())
}

// jittered is the loop's own backoff (idle passes, failing passes), seeded
// by the owner so replicas do not poll in lockstep.
func (f *Forwarder) jittered(base, ceiling time.Duration, n int, salt uint64) time.Duration {
	x := f.seed ^ (uint64(n) * 0x9E3779B97F4A7C15) ^ (salt << 32)
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	return spread(exp(base, ceiling, n), x)
}

func seedOf(owner string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(owner))
	return h.Sum64()
}

func exp(base, ceiling time.Duration, n int) time.Duration {
	if n < 1 {
		n = 1
	}
	d := float64(base) * math.Pow(2, float64(n-1))
	if d > float64(ceiling) || math.IsInf(d, 0) {
		return ceiling
	}
	return time.Duration(d)
}

func spread(d time.Duration, h uint64) time.Duration {
	frac := float64(h>>11) / float64(1<<53)
	return d/2 + time.Duration(frac*float64(d/2))
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
