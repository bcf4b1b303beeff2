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
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/migrations/schema"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
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
	// CodeDownstreamUnavailable: Ready's answer when the breaker of every
	// destination the relay publishes to is open.
	CodeDownstreamUnavailable outbox.Code = "FORWARDER_DOWNSTREAM_UNAVAILABLE"
	// CodeOutcomesNotWritten: a pass could not write its outcomes (the
	// database gone); its rows stay IN_FLIGHT until their leases expire. Run
	// and Close return it when it happens to the pass that drains on the way
	// out; otherwise the loop logs it and goes on.
	CodeOutcomesNotWritten outbox.Code = "FORWARDER_OUTCOMES_NOT_WRITTEN"
)

// Sentinels for errors.Is.
var (
	ErrClosed          = &outbox.Error{Code: CodeClosed}
	ErrAlreadyRunning  = &outbox.Error{Code: CodeAlreadyRunning}
	ErrUnknownOutcome  = &outbox.Error{Code: CodeUnknownOutcome}
	ErrHeartbeatLapsed = &outbox.Error{Code: CodeHeartbeatLapsed}
	// ErrDownstreamUnavailable matches Ready's refusal.
	ErrDownstreamUnavailable = &outbox.Error{Code: CodeDownstreamUnavailable}
	// ErrOutcomesNotWritten matches a pass's failed outcome write.
	ErrOutcomesNotWritten = &outbox.Error{Code: CodeOutcomesNotWritten}
)

// wakeGapDivisor: passes started by notifications begin at least
// PollInterval/wakeGapDivisor apart (50ms by default).
const wakeGapDivisor = 10

// errReleaseFailed marks the failed release of a batch claimed ahead on the
// way out; Close returns it like ErrOutcomesNotWritten.
var errReleaseFailed = errors.New("release failed")

const tracerName = "github.com/fencedoutbox/watermill-outbox/forwarder"

// Config.DBTimeout bounds each of the forwarder's own statements (the claim,
// the outcome batch), each on its own context: a pass may publish for up to
// LeaseDuration - 1.5 x PublishTimeout between them. They run on a context
// that stopping does not cancel: a claim cancelled half way could leave rows
// claimed but never published until their lease expires (and when one fails
// all the same, the rows it may hold are released: see releaseUnheld).

// Report counts what one pass did. Stale rows are possible duplicate
// publications: this relay's lease was gone when it wrote the outcome.
type Report struct {
	Claimed   int // rows the claim returned (including rows it parked)
	Published int
	Ambiguous int
	Failed    int
	Exhausted int // parked by this pass, or by the claim (expired lease, budget spent)
	Stale     int
	Released  int // claimed but not attempted (stopping, lease too short to start, the rest of a cut chain)
	// Chains is how many ordering keys the pass published a run of rows
	// for (each in seq order, one publish at a time); unkeyed rows are not
	// counted.
	Chains int
	// Unavailable counts rows put back without an attempt because their
	// downstream was unavailable as a whole (an unavailable verdict, the
	// evidence of a pass, or an open breaker); they are not in Released.
	Unavailable int
	// PossibleDuplicates counts rows confirmed now after an earlier attempt
	// whose outcome nobody knew (ambiguous, timed out, an expired lease):
	// the broker may have had them already.
	PossibleDuplicates int
	// ClaimFailures counts claim statements of the pass that failed (a row
	// that could not be read, a timeout, a cancelled context, a connection
	// lost while reading, or one that never reached the server: the client
	// cannot tell them apart, and such a claim may have committed).
	// ClaimReleased counts the rows then put back at once, without an
	// attempt, instead of waiting for their leases to expire (each expiry
	// spends one).
	ClaimFailures int
	ClaimReleased int
	// UnrecordedPublishes counts rows the downstream confirmed in this pass
	// whose outcome write then failed: they stay IN_FLIGHT until their
	// leases expire and are published again, so each is a possible
	// duplicate. They are not in Published or PossibleDuplicates.
	UnrecordedPublishes int
	// AbandonedPublishes is how many publishes left behind by their timeout
	// (a downstream that ignores its context) were still running when the
	// pass started. ClaimPaused: the pass claimed nothing because they were
	// more than Config.MaxAbandoned.
	AbandonedPublishes int
	ClaimPaused        bool
	// OpenBreakers are the destinations whose breaker is open after the
	// pass.
	OpenBreakers []BreakerState
	Duration     time.Duration
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
	start      claimStart // where each claim starts in the claimable index, and the key walk
	chains     chainLog   // which of this relay's chains were confirmed to their end
	chainCap   int        // rows of one key a claim takes before it looks at other keys
	breakers   breakers   // per destination: is the downstream down as a whole

	// claimMu makes one claim (with the release after a failed one) run at
	// a time. held are the rows this relay holds IN_FLIGHT (claimed, outcome
	// not yet written), with the local time of their claim: a failed claim
	// releases every other row of this owner. abandoned counts publishes
	// left running after their timeout.
	claimMu   sync.Mutex
	heldMu    sync.Mutex
	held      map[string]time.Time
	abandoned atomic.Int64
	// budgetShift halves the claims' byte budget once per failed claim and
	// doubles it back once per successful one (guarded by claimMu): a link
	// too slow to read MaxBatchBytes within DBTimeout still makes progress,
	// down to one row per claim, instead of failing the same claim forever.
	budgetShift int

	// Claims of Run wait for a fresh heartbeat: once it has lapsed,
	// relaymode.Enable may switch the database to CDC, and a relay still
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
	// drainErr is what Run returned when the drain on its way out failed to
	// write outcomes; Close returns it. Written before done is closed.
	drainErr error
	// routerErr is what Run returned under RouterPlugin (guarded by mu; see
	// RouterErr in router.go).
	routerErr error
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
	f := &Forwarder{
		db: db, q: q, out: out, cfg: cfg, metrics: m,
		logger:     logger.With(watermill.LogFields{"owner": cfg.Owner}),
		baseLogger: logger,
		tracer:     tp.Tracer(tracerName),
		seed:       seedOf(cfg.Owner),
		dbTimeout:  cfg.DBTimeout,
		chainCap:   max(1, (cfg.BatchSize+cfg.Concurrency-1)/cfg.Concurrency),
		beatEpoch:  time.Now(),
		stop:       make(chan struct{}),
		running:    make(chan struct{}),
		done:       make(chan struct{}),
	}
	f.breakers = breakers{
		threshold: cfg.BreakerThreshold, base: cfg.BreakerProbeBase, max: cfg.BreakerProbeMax,
		jitter: func(base, ceiling time.Duration, n int) time.Duration { return f.jittered(base, ceiling, n, 2) },
		now:    f.localNow,
	}
	return f, nil
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
// fails (database gone), which Run and Close both return (errors.Is
// ErrOutcomesNotWritten; the rows stay IN_FLIGHT until their leases
// expire). Safe to call twice, or before Run (Run then returns
// FORWARDER_CLOSED).
func (f *Forwarder) Close() error {
	f.mu.Lock()
	f.closed = true
	started := f.started
	f.mu.Unlock()
	f.stopOnce.Do(func() { close(f.stop) })
	var err error
	if started {
		<-f.done
		err = f.drainErr
	}
	if p, ok := f.q.(*fencing.Prepared); ok {
		// Releases the statements on the pool's connections; a RunOnce
		// after Close still works, unprepared.
		_ = p.Close()
	}
	return err
}

// Run relays until ctx is cancelled or Close is called; both drain the pass
// in progress. It refuses to start with RELAY_MODE_CONFLICT when the database
// records CDC mode, and stops with that error if a heartbeat finds the mode
// switched. A failing pass is logged and counted and the loop goes on. If
// the pass that drains on the way out cannot write its outcomes (or the
// release of a batch claimed ahead fails), Run returns that error
// (errors.Is ErrOutcomesNotWritten for the former), and so does Close:
// those rows stay IN_FLIGHT until their leases expire.
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
	defer func() {
		if errors.Is(err, ErrOutcomesNotWritten) || errors.Is(err, errReleaseFailed) {
			f.drainErr = err
		}
	}()

	// An unmigrated search_path is named with its remedy, not a raw 42P01.
	if err := schema.Check(ctx, f.db); err != nil {
		return err
	}

	ttl := 3 * f.cfg.HeartbeatInterval
	sent := time.Since(f.beatEpoch)
	if err := relaymode.BeatBudget(ctx, f.db, f.cfg.Owner, ttl, f.cfg.MaxAttempts); err != nil {
		return err
	}
	f.lastBeat.Store(int64(sent))
	f.beatTTL.Store(int64(ttl))
	defer f.beatTTL.Store(0)
	// A predecessor with the same owner that died left its breakers behind;
	// this relay's own start with every breaker closed.
	if _, err := f.db.ExecContext(ctx, `DELETE FROM messaging_relay_breaker WHERE owner = $1`, f.cfg.Owner); err != nil {
		f.logger.Error("Relay breakers of a previous run not removed", err, nil)
	}
	defer func() {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
		defer cancel()
		if err := relaymode.Leave(lctx, f.db, f.cfg.Owner); err != nil {
			f.logger.Error("Relay heartbeat not removed", err, nil)
		}
		if _, err := f.db.ExecContext(lctx, `DELETE FROM messaging_relay_breaker WHERE owner = $1`, f.cfg.Owner); err != nil {
			f.logger.Error("Relay breakers not removed", err, nil)
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
				err := relaymode.BeatBudget(hctx, f.db, f.cfg.Owner, ttl, f.cfg.MaxAttempts)
				cancel()
				if err == nil {
					f.lastBeat.Store(int64(sent))
				}
				if errors.Is(err, relaymode.ErrRelayModeConflict) {
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
			rerr = fmt.Errorf("forwarder: release the batch claimed ahead: %w: %w", errReleaseFailed, rerr)
			f.logger.Error("Outbox final release failed; its rows stay IN_FLIGHT until their leases expire", rerr, nil)
			err = errors.Join(err, rerr)
		}
	}()
	var idle, failures int
	var lastWoken time.Time // when the last pass a notification started began
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
		case cur.full, cur.rep.Chains > 0 && cur.rep.Published > 0, cur.ahead:
			// A full batch: more is waiting. Chains that moved: their keys
			// may have more behind them, claimable as soon as these outcomes
			// are written (a chain cut at its first row earns no re-poll). A
			// batch claimed ahead: it was claimed while its predecessor's
			// rows were still in flight, so it says nothing about what is
			// claimable now. Go again at once.
			failures, idle = 0, 0
		case claimed > 0:
			failures, idle = 0, 0
			delay = f.cfg.PollInterval
		default:
			failures = 0
			idle++
			delay = f.jittered(f.cfg.PollInterval, f.cfg.MaxPollInterval, idle, 1)
		}
		if f.stopRequested(ctx, stopping) {
			if errors.Is(err, ErrOutcomesNotWritten) {
				// The pass that drained on the way out could not write its
				// outcomes: its rows stay IN_FLIGHT, and the caller is told.
				return fmt.Errorf("forwarder: the last pass before stopping: %w", err)
			}
			f.logger.Info("Outbox forwarder stopped", nil)
			return nil
		}
		select {
		case err := <-fatal:
			f.stopOnce.Do(func() { close(f.stop) })
			return err
		default:
		}
		if next := f.breakers.nextProbe(); !next.IsZero() && delay > 0 {
			delay = max(0, min(delay, next.Sub(f.localNow())))
		}
		if delay == 0 {
			continue
		}
		// Any login may NOTIFY the channel, so a notification never cuts a
		// failure backoff, and passes it starts begin at least wakeGap apart
		// (a NOTIFY flood cannot turn the relay into a busy loop).
		wakeCh := wake
		if failures > 0 {
			wakeCh = nil
		}
		t := time.NewTimer(delay)
		deadline := time.Now().Add(delay)
		woken := false
	wait:
		for {
			select {
			case <-stopping:
				t.Stop()
				f.logger.Info("Outbox forwarder stopped", nil)
				return nil
			case err := <-fatal:
				t.Stop()
				f.stopOnce.Do(func() { close(f.stop) })
				return err
			case <-wakeCh:
				wakeCh, woken, idle = nil, true, 0
				if d := time.Until(lastWoken.Add(f.cfg.PollInterval / wakeGapDivisor)); d > 0 {
					t.Reset(min(d, time.Until(deadline)))
					continue
				}
				t.Stop()
				break wait
			case <-t.C:
				break wait
			}
		}
		if woken {
			lastWoken = time.Now()
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
	probe   bool  // claimed as its destination's breaker probe
	// unavailable: put back without an attempt because the downstream was
	// unavailable as a whole.
	unavailable bool
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
		if it.unavailable {
			return "unavailable"
		}
		return "released"
	}
	return "unknown"
}

// claimedBatch is the result of one claim and the local time just before
// it, which is where its rows' start-by deadline is measured from.
type claimedBatch struct {
	claimed   []fencing.Claimed
	claimedAt time.Time
	after     map[string]int64 // continued keys: the seq their chain continues
	probes    map[string]bool  // message ids claimed as breaker probes
	err       error
	failures  int // claim statements that failed after they were sent
	released  int // rows released because of them
}

// claim takes the next batch: unkeyed rows and chains, continuing the
// chains in cont (those of the batch in flight, for a claim made ahead).
//
// It may take several statements. The first walks the ordering keys only
// when keys had work at the last walk, or on every walkEvery-th claim
// (claimStart.walkDue): a claim that walks is planned afresh by PostgreSQL
// when no key has work, which costs more than the claim itself, so a relay
// draining unkeyed rows claims them with the plain statement. When the first
// comes back short from its start point, the unkeyed rows below the start
// point are claimed; when it is still short and did not walk the keys, they
// are walked for the rest (so that a short batch still means nothing more
// was claimable). When it is still
// short and some chains stopped at the chain cap (a cap that spreads a
// batch over several keys when there are several), those chains are
// extended by the room left, so a few hot keys still fill a batch.
func (f *Forwarder) claim(ctx context.Context, cont []fencing.Continuation) claimedBatch {
	if ttl := time.Duration(f.beatTTL.Load()); ttl > 0 {
		if age := time.Since(f.beatEpoch) - time.Duration(f.lastBeat.Load()); age > ttl {
			return claimedBatch{err: outbox.Errorf(CodeHeartbeatLapsed, "forwarder.claim",
				"no relay heartbeat succeeded for %s, longer than its lifetime %s: the database may have been switched to CDC meanwhile, so nothing is claimable until a heartbeat succeeds again (check the database connection)",
				age.Round(time.Millisecond), ttl)}
		}
	}
	f.claimMu.Lock()
	defer f.claimMu.Unlock()
	dbctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
	defer cancel()
	at := f.localNow()
	// Every statement below may commit on the server and still fail here
	// (a row the client cannot read, the timeout, the connection lost
	// while reading). The rows of each one that succeeds are recorded as
	// held; after one that fails, every other row this owner holds is
	// released (releaseUnheld), so a claimed batch is never dropped to wait
	// for its leases to expire.
	var failures, released int
	defer func() {
		switch {
		case failures > 0:
			f.budgetShift = min(f.budgetShift+1, 40)
		case f.budgetShift > 0:
			f.budgetShift--
		}
	}()
	maxBytes := max(1, f.cfg.MaxBatchBytes>>f.budgetShift)
	claimFn := func(p fencing.ClaimParams) ([]fencing.Claimed, error) {
		p.MaxBytes = f.byteBudget(p.MaxBytes)
		rows, err := fencing.Claim(dbctx, f.q, p)
		if err != nil {
			if !errors.Is(err, fencing.ErrInvalidArgument) {
				failures++
				released += f.releaseUnheld(ctx, err)
			}
			return nil, err
		}
		f.hold(rows, at)
		return rows, nil
	}
	from, cursor := f.start.from(), f.start.keyCursor()
	exclude, probes := f.breakers.forClaim()
	// Keys this relay published lately are resumed where their chains
	// ended, without looking for their heads (see chainLog), except on
	// every walkEvery-th claim, which walks every key.
	full := f.start.fullWalkDue()
	var resume []fencing.Continuation
	if !full {
		resume = f.chains.positions(cont, 2*f.cfg.BatchSize)
	}
	walk := full
	if len(cont)+len(resume) == 0 {
		walk = f.start.walkDue()
	}
	p := fencing.ClaimParams{
		Owner: f.cfg.Owner, Limit: f.cfg.BatchSize, Lease: f.cfg.LeaseDuration,
		MaxAttempts: f.cfg.MaxAttempts, Policy: f.cfg.OrderingPolicy, Now: f.dbNow(),
		FromSeq: from, KeyCursor: cursor, MaxChain: f.chainCap, Continue: append(cont[:len(cont):len(cont)], resume...),
		ExcludeDestinations: exclude, NoKeyWalk: !walk, MaxBytes: maxBytes,
	}
	claimed, err := claimFn(p)
	if err != nil {
		f.start.record(p.FromSeq, p.Limit, nil, err)
		return claimedBatch{claimedAt: at, err: err, failures: failures, released: released}
	}
	// What is left of the byte budget for the statements that complete the
	// batch (payloads only, as the client sees them: headers are small).
	budget := func() int64 { return maxBytes - payloadBytes(claimed) }
	if walk {
		f.start.walked(fencing.NextKeyCursor(cursor, claimed, cont), hasKeyed(claimed))
	}
	unkeyedFrom := p.FromSeq
	if p.FromSeq > 0 && len(claimed) < p.Limit && budget() > 0 {
		// Nothing more at or above the start point: look below it before
		// calling the batch short, so that a short batch (which sends Run
		// to idle) always means the whole claimable index had no more. The
		// rows claimed above are IN_FLIGHT under this relay now, so this
		// claim cannot take them again.
		below := p
		below.Limit, below.FromSeq, below.NoKeyWalk, below.Continue = p.Limit-len(claimed), 0, true, nil
		below.MaxBytes = budget()
		more, berr := claimFn(below)
		if berr != nil {
			// The rows claimed above the start are held and go on; record
			// makes the next claim start at the first entry.
			f.logger.Error("Outbox claim below the start point failed", berr, watermill.LogFields{"held": len(claimed)})
		}
		claimed = mergeBySeq(claimed, more)
		unkeyedFrom = 0 // this batch looked at the whole index
	}
	f.start.record(unkeyedFrom, p.Limit, unkeyedOnly(claimed), nil)
	if !walk && len(claimed) < p.Limit && budget() > 0 {
		// The batch is short without looking at keys: walk them for the
		// rest before calling it short, so that a short batch still means
		// nothing more was claimable.
		keyed := p
		keyed.Limit, keyed.FromSeq, keyed.NoKeyWalk, keyed.NoUnkeyed = p.Limit-len(claimed), 0, false, true
		keyed.Continue = cont // resumed keys were claimed above: walked again, their heads are held
		keyed.MaxBytes = budget()
		rows, kerr := claimFn(keyed)
		if kerr != nil {
			f.logger.Error("Outbox claim of keyed rows failed", kerr, watermill.LogFields{"held": len(claimed)})
		} else {
			f.start.walked(fencing.NextKeyCursor(cursor, rows, nil), len(rows) > 0)
			claimed = mergeBySeq(claimed, rows)
		}
	}
	if ext := capped(claimed, f.chainCap, p.Continue); len(ext) > 0 && len(claimed) < p.Limit && budget() > 0 {
		room := p.Limit - len(claimed)
		more := p
		more.Limit, more.MaxChain, more.Continue = room, (room+len(ext)-1)/len(ext), ext
		more.NoKeyWalk, more.NoUnkeyed, more.FromSeq, more.MaxBytes = true, true, 0, budget()
		if rows, xerr := claimFn(more); xerr != nil {
			f.logger.Error("Outbox claim extending chains failed", xerr, watermill.LogFields{"held": len(claimed)})
		} else {
			claimed = mergeBySeq(claimed, rows)
		}
	}
	// A probe per open breaker whose probe is due: one row of its
	// destination, keyed or not.
	var probed map[string]bool
	for _, dest := range probes {
		pr := p
		pr.Limit, pr.MaxChain, pr.Continue, pr.FromSeq = 1, 1, nil, f.breakers.probeFrom(dest)
		pr.ExcludeDestinations, pr.OnlyDestination, pr.NoKeyWalk, pr.NoUnkeyed = nil, dest, false, false
		rows, perr := claimFn(pr)
		if perr == nil && len(rows) == 0 && pr.FromSeq > 1 {
			pr.FromSeq = 0 // past the last row: wrap around
			rows, perr = claimFn(pr)
		}
		if perr != nil {
			f.logger.Error("Outbox breaker probe claim failed", perr, watermill.LogFields{"destination": dest})
			continue
		}
		if len(rows) == 0 {
			// Nothing of the destination waits (another relay delivered
			// it, or it was parked): an open breaker has nothing left to
			// protect. It closes; the next publish there tells again.
			if f.breakers.success(dest) {
				f.breakerChanged(dest, false, "")
			}
			continue
		}
		f.breakers.probed(dest, rows[0].Row.Seq)
		for _, r := range rows {
			if probed == nil {
				probed = make(map[string]bool)
			}
			probed[r.Row.MessageID] = true
		}
		claimed = mergeBySeq(claimed, rows)
	}
	var after map[string]int64
	for _, c := range p.Continue {
		if after == nil {
			after = make(map[string]int64, len(cont))
		}
		after[c.Key] = c.AfterSeq
	}
	return claimedBatch{claimed: claimed, claimedAt: at, after: after, probes: probed, failures: failures, released: released}
}

// capped are the continuations of the chains the walk found that stopped at
// the cap (a continued chain, cont, is capped by the batch only).
func capped(claimed []fencing.Claimed, limit int, cont []fencing.Continuation) []fencing.Continuation {
	var rows map[string]int
	for _, c := range claimed {
		k := c.Row.OrderingKey
		if k != "" && !slices.ContainsFunc(cont, func(x fencing.Continuation) bool { return x.Key == k }) {
			if rows == nil {
				rows = make(map[string]int)
			}
			rows[k]++
		}
	}
	if rows == nil {
		return nil
	}
	return slices.DeleteFunc(continuations(claimed), func(c fencing.Continuation) bool { return rows[c.Key] < limit })
}

func hasKeyed(claimed []fencing.Claimed) bool {
	return slices.ContainsFunc(claimed, func(c fencing.Claimed) bool { return c.Row.OrderingKey != "" })
}

func unkeyedOnly(claimed []fencing.Claimed) []fencing.Claimed {
	out := make([]fencing.Claimed, 0, len(claimed))
	for _, c := range claimed {
		if c.Row.OrderingKey == "" {
			out = append(out, c)
		}
	}
	return out
}

func mergeBySeq(a, b []fencing.Claimed) []fencing.Claimed {
	if len(b) == 0 {
		return a
	}
	out := append(a, b...)
	slices.SortFunc(out, func(x, y fencing.Claimed) int { return cmp.Compare(x.Row.Seq, y.Row.Seq) })
	return out
}

// tail is the second half of a pass: writing its outcomes and reporting.
// Under Run it may still be running while the next pass publishes.
type tail struct {
	ahead bool // its batch was claimed ahead, while the previous one was in flight
	full  bool // its claim was cut by BatchSize or (about) by MaxBatchBytes: more may wait
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
	t.rep.OpenBreakers = f.breakers.open()
	t.rep.Duration = time.Since(t.start)
	t.err = err
	f.metrics.pass(t.rep.Claimed, err != nil)
	f.metrics.contained(t.rep)
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
	t = &tail{start: time.Now(), done: make(chan struct{}), ahead: pre != nil}
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
		if f.claimPaused(t) {
			behind.wait()
			f.end(t, nil)
			return t, nil
		}
		b = f.claim(ctx, nil)
	}
	t.rep.AbandonedPublishes = max(t.rep.AbandonedPublishes, int(f.abandoned.Load()))
	t.rep.ClaimFailures, t.rep.ClaimReleased = b.failures, b.released
	claimed := b.claimed
	if b.err != nil || len(claimed) == 0 {
		behind.wait()
		f.end(t, b.err)
		return t, nil
	}
	t.rep.Claimed = len(claimed)
	t.full = f.full(claimed)
	if prefetch && f.full(claimed) && f.abandoned.Load() <= int64(f.cfg.MaxAbandoned) {
		select {
		case <-stopping:
		default:
			ch := make(chan claimedBatch, 1) // buffered: the claim never waits for its reader
			cont := continuations(claimed)
			go func() { ch <- f.claim(ctx, cont) }()
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
	units := make([]unit, 0, len(claimed))
	var chainOf map[string]int // ordering key -> its unit
	for i, c := range claimed {
		it := &items[i]
		it.claimed, it.probe = c, b.probes[c.Row.MessageID]
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
				break
			}
			it.msg = msg
		}
		key := c.Row.OrderingKey
		if key == "" {
			if it.msg != nil {
				units = append(units, unit{items: []*item{it}})
			}
			continue
		}
		// A key's rows stay together, in seq order (Claim returns them so),
		// rows that will not be published included: they end the chain.
		u, seen := chainOf[key]
		if !seen {
			if chainOf == nil {
				chainOf = make(map[string]int)
			}
			u = len(units)
			chainOf[key] = u
			units = append(units, unit{key: key, after: b.after[key]})
		}
		units[u].items = append(units[u].items, it)
	}
	t.rep.Chains = len(chainOf)

	f.publishAll(units, startBy, stopping, drainExpired)
	f.chains.endPass()
	f.passEvidence(items)

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
		for _, it := range written {
			if it.verdict() == "published" {
				t.rep.UnrecordedPublishes++
			}
		}
		f.logger.Error("Outbox outcomes not written: these rows stay IN_FLIGHT until their leases expire and are then claimed again, so those already published may be published twice", err, watermill.LogFields{
			"rows": len(outcomes), "message_ids": ids, "lease_tokens": tokens, "unrecorded_publishes": t.rep.UnrecordedPublishes,
		})
		f.end(t, outbox.Wrap(CodeOutcomesNotWritten, "forwarder.pass", err, fmt.Sprintf("write outcomes of %d rows", len(outcomes))))
		return
	}
	f.unhold(outcomes)
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
		case "unavailable":
			rep.Unavailable++
		}
		if verdict == "published" && (row.Attempts > 0 || row.LastFailureCode == FailureDownstreamFailing) {
			rep.PossibleDuplicates++
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

// passEvidence applies the default classifier's pass-wide rule: when every
// publish of the pass to a destination failed ambiguously with the same
// error, on two messages or more (or on a probe, with the error that opened
// the breaker), the destination is taken to be unavailable: those rows are
// put back without an attempt and its breaker opens. Timeouts and panics
// are not evidence (the broker may have taken those messages), nor is a
// single message otherwise (a poison message fails alone).
func (f *Forwarder) passEvidence(items []item) {
	if !f.cfg.defaultClassifier {
		return
	}
	type tally struct {
		failed []*item
		text   string
		mixed  bool
	}
	var by map[string]*tally
	for i := range items {
		it := &items[i]
		if it.msg == nil || it.err == nil && it.outcome.To != envelope.StatusPublished {
			continue // not attempted
		}
		if by == nil {
			by = make(map[string]*tally)
		}
		dest := it.claimed.Row.Destination
		t := by[dest]
		if t == nil {
			t = &tally{}
			by[dest] = t
		}
		switch {
		case t.mixed:
		case it.outcome.Code != FailurePublishError || (it.outcome.To != envelope.StatusAmbiguous && it.outcome.To != envelope.StatusExhausted):
			t.mixed = true
		case len(t.failed) > 0 && errText(it.err) != t.text:
			t.mixed = true
		default:
			t.failed, t.text = append(t.failed, it), errText(it.err)
		}
	}
	for dest, t := range by {
		if t.mixed || len(t.failed) == 0 {
			continue
		}
		// One message alone is evidence only as a probe failing the way the
		// failure that opened the breaker did, the first time that message
		// is probed (otherwise a long outage would spend its probes'
		// budgets; a message probed again spends one).
		if len(t.failed) < 2 && !(t.failed[0].probe && f.breakers.probeLikeOutage(dest, t.failed[0].claimed.Row.MessageID, t.text)) {
			continue
		}
		hold := f.breakers.holdOff(dest, f.cfg.BreakerProbeBase)
		for _, it := range t.failed {
			// Back without an attempt, but remembered as possibly taken
			// (the default classifier cannot tell), and held off so that
			// probes take other rows.
			it.outcome = fencing.Outcome{To: envelope.StatusPending, Code: FailureDownstreamFailing,
				Detail:     "every publish to this destination in the pass failed the same way: " + t.text,
				RetryAfter: hold}
			it.unavailable = true
		}
		if f.breakers.trip(dest, t.text) {
			f.breakerChanged(dest, true, t.text)
		}
	}
}

// breakerChanged reports a breaker's change of state: once per change, never
// per message.
func (f *Forwarder) breakerChanged(dest string, open bool, why string) {
	f.metrics.breaker(dest, open)
	f.recordBreaker(dest, open, why)
	if open {
		f.logger.Error("Outbox destination unavailable: breaker open; its rows wait without spending attempts, probing with one row at a time", nil,
			watermill.LogFields{"destination": dest, "error": why})
		return
	}
	f.logger.Info("Outbox destination available again: breaker closed", watermill.LogFields{"destination": dest})
}

// recordBreaker writes the change to messaging_relay_breaker for operators
// (outboxctl status), under Run only (a relay with a heartbeat); best effort,
// a failure is logged.
func (f *Forwarder) recordBreaker(dest string, open bool, why string) {
	if f.beatTTL.Load() == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), f.dbTimeout)
	defer cancel()
	var err error
	if open {
		_, err = f.db.ExecContext(ctx, `INSERT INTO messaging_relay_breaker (owner, destination, last_error)
VALUES ($1, $2, nullif($3, ''))
ON CONFLICT (owner, destination) DO UPDATE SET opened_at = now(), last_error = excluded.last_error`,
			f.cfg.Owner, dest, fencing.CleanText(why, fencing.MaxFailureDetail))
	} else {
		_, err = f.db.ExecContext(ctx, `DELETE FROM messaging_relay_breaker WHERE owner = $1 AND destination = $2`, f.cfg.Owner, dest)
	}
	if err != nil {
		f.logger.Error("Outbox breaker state not recorded for operators", err, watermill.LogFields{"destination": dest, "open": open})
	}
}

// Ready reports whether the relay can deliver anything: an error with code
// FORWARDER_DOWNSTREAM_UNAVAILABLE naming the destinations when the breaker
// of every destination it has published to is open. The relay is alive
// meanwhile (it probes), but not ready.
func (f *Forwarder) Ready() error {
	if open, all := f.breakers.allOpen(); all {
		names := make([]string, len(open))
		for i, b := range open {
			names[i] = b.Destination
		}
		return outbox.Errorf(CodeDownstreamUnavailable, "forwarder.Ready",
			"every destination this relay publishes to is unavailable (breaker open: %v); it probes them and resumes on its own", names)
	}
	return nil
}

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
