package forwarder

import (
	"database/sql"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// env is what every stage of the relay reads (the claimer, the executor,
// the completer and the Forwarder that composes them share one): the
// configuration and the handles New built. Nothing in it changes once Run
// or RunOnce started (export_test.go's SetDBTimeout and WrapStatements set
// dbTimeout and q before).
type env struct {
	cfg Config
	db  *sql.DB
	// q runs the claim and outcome statements: on the connection pinned
	// for them when the context carries it (routed), else on db or its
	// prepared form.
	q        fencing.DBTX
	prepared *fencing.Prepared // nil with DisablePreparedStatements
	// claimConn and outcomeConn are the connections the claims and the
	// outcome writes prefer (pinned): one with Config.ShareConnection.
	claimConn, outcomeConn *pinned
	// draining is whether the latest claim came back full (the
	// connections stay pinned only then).
	draining   atomic.Bool
	logger     watermill.LoggerAdapter // with the owner's field
	baseLogger watermill.LoggerAdapter // as given, for the optional Warner
	tracer     trace.Tracer
	metrics    *metrics
	seed       uint64 // from the owner: per-relay jitter, deterministic per owner
	dbTimeout  time.Duration
}

// beatGate holds claims back once the relay's heartbeat lapsed (see
// Forwarder.Run): the claimer reads it before each claim and the executor
// before recording a breaker for operators; Run's heartbeat writes it.
//
// Claims of Run wait for a fresh heartbeat: once it has lapsed,
// relaymode.Enable may switch the database to CDC, and a relay still
// claiming would race the connector. lastBeat is when the last successful
// Beat was sent (time since epoch, monotonic; the database's expires_at
// counts from later); ttl is zero outside Run (no gate).
type beatGate struct {
	epoch    time.Time
	lastBeat atomic.Int64
	ttl      atomic.Int64
}

// sent records a successful beat sent at since (time since epoch).
func (b *beatGate) sent(since time.Duration) { b.lastBeat.Store(int64(since)) }

// since is the time since epoch, for a beat about to be sent.
func (b *beatGate) since() time.Duration { return time.Since(b.epoch) }

// lapsed reports the heartbeat's age when it is older than its lifetime
// (ok false: no gate, or a fresh beat).
func (b *beatGate) lapsed() (age, ttl time.Duration, ok bool) {
	ttl = time.Duration(b.ttl.Load())
	if ttl <= 0 {
		return 0, 0, false
	}
	age = time.Since(b.epoch) - time.Duration(b.lastBeat.Load())
	return age, ttl, age > ttl
}

// underRun reports whether Run holds the gate (a relay with a heartbeat).
func (b *beatGate) underRun() bool { return b.ttl.Load() != 0 }

// Warner is implemented by loggers that have a warning level; watermill's
// LoggerAdapter has none, so warnings go to Info with severity=warn
// otherwise.
type Warner interface {
	Warn(msg string, fields watermill.LogFields)
}

func (e *env) warn(msg string, fields watermill.LogFields) {
	fields = watermill.LogFields{"owner": e.cfg.Owner}.Add(fields)
	if w, ok := e.baseLogger.(Warner); ok {
		w.Warn(msg, fields)
		return
	}
	e.logger.Info(msg, fields.Add(watermill.LogFields{"severity": "warn"}))
}
