package forwarder

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/startstop"
	"github.com/fencedoutbox/watermill-outbox/migrations/schema"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Codes returned by the forwarder (configuration refusals use
// OUTBOX_INVALID_CONFIG and OUTBOX_LEASE_TOO_SHORT; a CDC database refuses
// Run with relaymode's RELAY_MODE_CONFLICT).
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

// Forwarder is the fenced relay: it moves committed outbox rows to a
// watermill publisher. Create it with New, run it with Run (or a Router via
// RouterPlugin), stop it with Close.
type Forwarder struct {
	*env // the configuration and handles every stage shares

	// The stages of a pass, handing each batch one way: the claimer takes
	// it, the executor publishes it, the completer writes its outcomes and
	// hands back to the claimer what the batch held.
	claimer   *claimer
	executor  *executor
	completer *completer

	beat *beatGate // Run's heartbeat, which claims wait for

	// life is Run's start and stop: Run once, Close idempotent, also before
	// Run, and waiting for Run. What Run leaves it (Finish) is what Close
	// returns: the error of a drain on the way out that failed to write
	// outcomes.
	life *startstop.Life
	// routerErr is what Run returned under RouterPlugin (see RouterErr in
	// router.go).
	routerErr atomic.Pointer[error]
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
	m, err := newMetrics(cfg.Metrics, cfg.MaxBatchSize)
	if err != nil {
		return nil, outbox.Wrap(outbox.CodeInvalidConfig, op, err, "register metrics")
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	var pool fencing.DBTX = db
	var prepared *fencing.Prepared
	if !cfg.DisablePreparedStatements {
		prepared = fencing.NewPrepared(db)
		pool = prepared
	}
	e := &env{
		db: db, q: routed{pool: pool}, prepared: prepared, cfg: cfg, metrics: m,
		logger:     logger.With(watermill.LogFields{"owner": cfg.Owner}),
		baseLogger: logger,
		tracer:     tp.Tracer(tracerName),
		seed:       seedOf(cfg.Owner),
		dbTimeout:  cfg.DBTimeout,
	}
	pin := func(shareWait time.Duration) *pinned {
		return newPinned(db, !cfg.DisablePreparedStatements, e.draining.Load, shareWait)
	}
	if cfg.ShareConnection {
		e.claimConn = pin(pinShareWait)
		e.outcomeConn = e.claimConn
	} else {
		e.claimConn, e.outcomeConn = pin(0), pin(0)
	}
	beat := &beatGate{epoch: time.Now()}
	cl := newClaimer(e, beat)
	x := newExecutor(e, out, &cl.chains, &cl.paces, beat)
	cl.probes = x
	f := &Forwarder{
		env:       e,
		claimer:   cl,
		executor:  x,
		completer: &completer{env: e, claims: cl, breakers: &x.breakers},
		beat:      beat,
		life:      startstop.New(),
	}
	return f, nil
}

// Owner is the lease owner this forwarder writes.
func (f *Forwarder) Owner() string { return f.cfg.Owner }

// Config returns the configuration with defaults filled in.
func (f *Forwarder) Config() Config { return f.cfg }

// Running is closed once Run has passed its start-up checks and polls.
func (f *Forwarder) Running() chan struct{} { return f.life.Running() }

// Close stops the loop and waits for Run to return. The pass in progress is
// drained: publishes already started get up to DrainTimeout to finish,
// rows not yet started are released, and every outcome is written, so no
// row is left IN_FLIGHT under this relay's name — unless that last write
// fails (database gone), which Run and Close both return (errors.Is
// ErrOutcomesNotWritten; the rows stay IN_FLIGHT until their leases
// expire). Safe to call twice, or before Run (Run then returns
// FORWARDER_CLOSED).
func (f *Forwarder) Close() error {
	started, err := f.life.Close()
	if !started {
		// Lanes taken by RunOnce calls go back now rather than when their
		// lease expires.
		ctx, cancel := context.WithTimeout(context.Background(), f.dbTimeout)
		f.claimer.giveBackLanes(ctx)
		cancel()
	}
	if f.prepared != nil {
		// Releases the statements on the pool's connections; a RunOnce
		// after Close still works, unprepared.
		_ = f.prepared.Close()
	}
	f.claimConn.close()
	f.outcomeConn.close()
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
	switch err := f.life.Start(); {
	case errors.Is(err, startstop.ErrClosed):
		return outbox.Errorf(CodeClosed, "forwarder.Run", "the forwarder was closed; create a new one")
	case err != nil:
		return outbox.Errorf(CodeAlreadyRunning, "forwarder.Run", "Run was already called on this forwarder")
	}
	defer func() {
		// What Close returns: the drain on the way out that failed to
		// write outcomes (or to release the batch claimed ahead).
		var drainErr error
		if errors.Is(err, ErrOutcomesNotWritten) || errors.Is(err, errReleaseFailed) {
			drainErr = err
		}
		f.unpin() // a stopped relay holds no connection of the pool
		f.life.Finish(drainErr)
	}()

	// An unmigrated search_path is named with its remedy, not a raw 42P01.
	if err := schema.Check(ctx, f.db); err != nil {
		return err
	}

	ttl := 3 * f.cfg.HeartbeatInterval
	sent := f.beat.since()
	if err := relaymode.BeatFence(ctx, f.db, f.cfg.Owner, ttl, f.cfg.MaxAttempts, f.beatFence()); err != nil {
		return err
	}
	f.beat.sent(sent)
	f.beat.ttl.Store(int64(ttl))
	defer f.beat.ttl.Store(0)
	if err := f.claimer.enterFence(ctx); err != nil {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
		defer cancel()
		_ = relaymode.Leave(lctx, f.db, f.cfg.Owner)
		return err
	}
	// A predecessor with the same owner that died left its breakers behind;
	// this relay's own start with every breaker closed.
	if _, err := f.db.ExecContext(ctx, `DELETE FROM messaging_relay_breaker WHERE owner = $1`, f.cfg.Owner); err != nil {
		f.logger.Error("Relay breakers of a previous run not removed", err, nil)
	}
	defer func() {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
		defer cancel()
		f.claimer.giveBackLanes(lctx)
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
		f.claimer.waitFloors()
	}()
	stopping, drainExpired := f.stopSignals(ctx, exit)

	// Heartbeat: a CDC switch made while this relay's heartbeat lapsed is
	// fatal, anything else (database briefly down) is logged.
	fatal := make(chan error, 1)
	bg.Add(1)
	go func() {
		defer bg.Done()
		f.heartbeat(ctx, stopping, ttl, fatal)
	}()

	wake := f.listen(stopping, &bg)
	f.life.SetRunning()
	f.logger.Info("Outbox forwarder running", watermill.LogFields{
		"batch_size": f.cfg.BatchSize, "max_batch_size": f.cfg.MaxBatchSize, "concurrency": f.cfg.Concurrency, "ordering_policy": f.cfg.OrderingPolicy.String(),
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
		switch _, rerr := t.wait(); {
		case rerr != nil && t.rep.Claimed == 0:
			// The claim ahead failed (a pass that claimed rows has its error
			// from their release): it holds nothing (a lapsed heartbeat
			// refuses it before it runs; a failed statement's rows are
			// released by the claim, or that failure logged there). A
			// failing pass like any other, logged, not a release that left
			// rows IN_FLIGHT.
			f.logger.Error("Outbox claim ahead failed before stopping", rerr, nil)
		case rerr != nil:
			rerr = fmt.Errorf("forwarder: release the batch claimed ahead: %w: %w", errReleaseFailed, rerr)
			f.logger.Error("Outbox final release failed; its rows stay IN_FLIGHT until their leases expire", rerr, nil)
			err = errors.Join(err, rerr)
		}
	}()
	var idle, failures int
	var limit wakeLimit
	var wokenAt time.Time
	var woken bool
	for {
		cur, pre := f.pass(ctx, stopping, drainExpired, next, !f.cfg.DisablePrefetch, behind)
		var err error
		if behind != nil {
			_, err = behind.wait() // finished: pass waits for it before writing its own outcomes
		}
		next, behind = pre, nil
		claimed := cur.rep.Claimed
		if woken {
			limit.passed(wokenAt, claimed)
		}
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
		case cur.rep.ClaimPaused:
			// Paused (too many publishes left running), not idle: it did not
			// look, so the wait does not grow, and the relay resumes within
			// PollInterval once the publishes left behind return.
			failures, idle = 0, 0
			delay = f.cfg.PollInterval
		default:
			failures = 0
			if gap, moving := f.claimer.lanesInMotion(); moving {
				// Idle, but its lanes are changing hands: the lanes it is to
				// give back, or to take, and the rows in them, wait for its
				// next pass (claimLanes). Backing off, it left them unserved
				// for up to MaxPollInterval, or until its next renewal (four
				// relays on a 50,000-row backlog drained at 4,000 msg/s
				// against one relay's 48,000: 5,744 rows sat for 10 s in lanes
				// over a share, marked but not yet given back).
				idle, delay = 0, gap
			} else {
				idle++
				delay = f.jittered(f.cfg.PollInterval, f.cfg.MaxPollInterval, idle, 1)
			}
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
			f.life.Stop()
			return err
		default:
		}
		// A due breaker probe cuts the wait, but not while claims are paused
		// (too many publishes left running) nor after a pass that failed (a
		// claim the database refused): such a pass runs no probe, so the
		// probe would stay due and the loop would spin, past the backoff.
		if next := f.executor.breakers.nextProbe(); !next.IsZero() && delay > 0 && !cur.rep.ClaimPaused && err == nil {
			delay = max(0, min(delay, next.Sub(f.localNow())))
		}
		woken = false
		if delay == 0 {
			continue
		}
		// Any login may NOTIFY the channel, so a notification never cuts a
		// failure backoff.
		wakeCh := wake
		if failures > 0 {
			wakeCh = nil
		}
		var stop bool
		woken, stop, err = f.sleep(delay, wakeCh, stopping, fatal, limit.idleAt)
		switch {
		case err != nil:
			f.life.Stop()
			return err
		case stop:
			f.logger.Info("Outbox forwarder stopped", nil)
			return nil
		case woken:
			idle, wokenAt = 0, time.Now()
		}
	}
}
