package forwarder

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
)

// pinned keeps one connection of the relay's pool for one kind of
// statement while the relay drains full batches: by default the claims on
// one, the outcome writes on another; with Config.ShareConnection both on
// one, taking turns. A relay that keeps up (its claims come back short)
// pins nothing, so a pool it shares with the service is not held by an
// idle relay.
//
// Why: every PostgreSQL backend that reads the outbox maps the shared
// buffers it touches into its own page tables, one page fault per page the
// first time, and plans and caches the relay's statements for itself. Left
// to the pool, a pipelining relay's claims and outcomes move between three
// connections (the pool hands out the connection freed last, and the
// heartbeat's joins them), so three backends each pay that. On the
// project's 2-core host a 50,000-row drain cost the server 24,400 page
// faults on three backends against 5,600 for the minimal relay's one
// (`perf record -e minor-faults`), at about 16 µs each there; pinned,
// 12,500.
//
// Why two by default: a claim running beside an outcome on a second
// backend costs the server more CPU than the two one after the other (more
// page pruning, likely because each one's snapshot keeps the other's dead
// row versions from being removed), but one relay drains faster, the server's work spread over two cores. On
// one backend (ShareConnection) the server's CPU per message fell (median
// 18 %) and one relay drained slower in most paired runs (5 to 23 %); four
// relays on 100 keys drained 9 to 21 % faster (BENCHMARKS.md, session 10).
//
// A pinned connection is only ever a preference: a statement that finds it
// in use (a second outcome write while the first runs) waits for it at most
// shareWait (0 without ShareConnection: not at all) and a quarter of the
// time left before its deadline, then runs on the pool, as does one that
// cannot have it. It pins only when the pool leaves a connection for
// everything else (MaxOpenConns 0 or at least 3, and one connection still
// free after it: several relays, or the service, may share the pool);
// otherwise the heartbeat would wait behind connections that never go back
// to the pool. A connection whose failure may have
// ended it (lost, timed out, cancelled, or the session ended by the
// server) goes back to the pool, which discards it when it is broken, and
// the next statement takes another. Every repinAfter the pinned connection
// goes back to the pool too, so the pool's ConnMaxLifetime and
// ConnMaxIdleTime still apply within that much.
type pinned struct {
	db      *sql.DB
	prepare bool          // prepare the hot statements on it (fencing.NewPreparedConn)
	maxAge  time.Duration // repinAfter
	// busy reports whether the relay is draining full batches: only then
	// does a connection stay pinned between statements (nil: always).
	busy func() bool
	// slot holds the idle pinned connection (nil: none yet); empty while a
	// statement uses it.
	slot chan *pinnedConn
	// shareWait bounds how long a statement waits for the pinned connection
	// while another uses it (0: it never waits); waiting counts those
	// waiting now.
	shareWait time.Duration
	waiting   atomic.Int32

	closed atomic.Bool
}

// repinAfter is how long a connection stays pinned before it goes back
// to the pool (see pinned).
const repinAfter = time.Minute

// pinWait bounds how long take waits for a connection when the idle one it
// saw was taken meanwhile; the caller then uses the pool.
const pinWait = 50 * time.Millisecond

// pinShareWait is how long a claim or an outcome write waits for the
// pinned connection while the other runs on it (Config.ShareConnection):
// longer than either takes for a full batch on a busy host, short enough
// that a statement held up by a slow one is soon on a connection of its
// own.
const pinShareWait = 250 * time.Millisecond

func newPinned(db *sql.DB, prepare bool, busy func() bool, shareWait time.Duration) *pinned {
	p := &pinned{db: db, prepare: prepare, busy: busy, maxAge: repinAfter, slot: make(chan *pinnedConn, 1), shareWait: shareWait}
	p.slot <- nil
	return p
}

// take returns the pinned connection for one caller until give, or nil
// when another caller kept it past shareWait, pinning is off (the relay
// keeps up, a pool of one or two connections or with none to spare, or
// after close) or no connection could be had. The caller then uses the
// pool.
func (p *pinned) take(ctx context.Context) *pinnedConn {
	st := p.db.Stats()
	if n := st.MaxOpenConnections; n > 0 && n < 3 {
		return nil
	}
	var c *pinnedConn
	select {
	case c = <-p.slot:
	default:
		// In use: wait for it (ShareConnection), then the pool.
		var ok bool
		if c, ok = p.await(ctx); !ok {
			return nil
		}
		st = p.db.Stats() // after the wait: the pool as it is now
	}
	if c != nil && poolClosed(p.db) {
		// Closing the pool stops the statements of the connections in use
		// only when they go back to it: this one never would.
		c.release()
		c = nil
	}
	if c == nil {
		switch {
		case p.closed.Load(), p.busy != nil && !p.busy():
			// Closed, or the relay keeps up: its statements stay on the
			// pool, prepared there once per connection (a connection
			// pinned for one statement would prepare it again each time).
			p.slot <- nil
			return nil
		case st.Idle == 0, st.MaxOpenConnections > 0 && st.InUse+2 > st.MaxOpenConnections:
			// Only an idle connection is pinned: a pin never waits for
			// the pool (a full pool held an outcome write until its
			// deadline) nor opens a connection. And the pool keeps one
			// for anything else (several relays, or the service, may
			// share it).
			p.slot <- nil
			return nil
		}
		// The idle connection may be taken meanwhile: pinWait bounds
		// the wait for another.
		cctx, cancel := context.WithTimeout(ctx, pinWait)
		conn, err := p.db.Conn(cctx)
		cancel()
		if err != nil {
			p.slot <- nil
			return nil
		}
		c = &pinnedConn{conn: conn, q: conn, since: time.Now()}
		if p.prepare {
			c.prepared = fencing.NewPreparedConn(conn)
			c.q = c.prepared
		}
	}
	return c
}

// await waits for the slot another caller holds, at most waitBound(ctx):
// what it then holds (nil: nothing pinned), or false when the wait ran
// out.
func (p *pinned) await(ctx context.Context) (*pinnedConn, bool) {
	wait := p.waitBound(ctx)
	if wait <= 0 {
		return nil, false
	}
	p.waiting.Add(1)
	defer p.waiting.Add(-1)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case c := <-p.slot:
		return c, true
	case <-t.C:
	case <-ctx.Done():
	}
	return nil, false
}

// waitBound is how long a statement whose context is ctx may wait for the
// pinned connection: shareWait, and at most a quarter of the time left
// before ctx's deadline. The statement's own deadline (DBTimeout) runs
// while it waits; without the quarter, a relay with a short DBTimeout spent
// it waiting and its outcome writes failed, leaving published rows to be
// published again.
func (p *pinned) waitBound(ctx context.Context) time.Duration {
	wait := p.shareWait
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl)/4)
	}
	return wait
}

// unpin gives the relay's idle pinned connections back to the pool (Run's
// and RunOnce's end); the next claim that drains pins again.
func (e *env) unpin() {
	e.claimConn.unpin()
	e.outcomeConn.unpin()
}

// poolClosed reports whether db was closed. database/sql refuses a closed
// pool before it looks at the caller's context, so asking with a context
// already cancelled takes no connection and costs no round trip.
func poolClosed(db *sql.DB) bool {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	c, err := db.Conn(ctx)
	if err == nil { // not expected; a connection is a connection
		_ = c.Close()
		return false
	}
	return !errors.Is(err, context.Canceled)
}

// give returns c (from take; nil is a no-op) for the next caller, or to
// the pool when a failure may have ended it (connectionLost), when the
// relay is not draining full batches, when it was pinned for repinAfter,
// or after close.
func (p *pinned) give(c *pinnedConn) {
	if c == nil {
		return
	}
	if p.closed.Load() || c.failed || (p.busy != nil && !p.busy()) || !c.valid() || time.Since(c.since) >= p.maxAge {
		c.release()
		c = nil
	}
	p.slot <- c
}

// close gives the pinned connection back to the pool and pins no more
// (take then returns nil).
func (p *pinned) close() {
	p.closed.Store(true)
	p.unpin()
}

// unpin gives the idle pinned connection back to the pool; the next take
// pins one again. A connection in use goes back when given after close, or
// stays pinned.
func (p *pinned) unpin() {
	select {
	case c := <-p.slot:
		if c != nil {
			c.release()
		}
		p.slot <- nil
	default: // in use: give releases it
	}
}

// pinnedConn is a pinned connection as a fencing.DBTX. It notes a failure
// that may have ended the connection (connectionLost), so that give does
// not keep it.
type pinnedConn struct {
	conn     *sql.Conn
	prepared *fencing.Prepared // nil when the relay does not prepare
	q        fencing.DBTX      // prepared, or conn
	since    time.Time
	failed   bool
}

var _ fencing.DBTX = (*pinnedConn)(nil)

func (c *pinnedConn) note(err error) {
	if err != nil && connectionLost(pgerr.State(err)) {
		c.failed = true
	}
}

// connectionLost reports whether an error of SQLSTATE state ("" for an
// error not from PostgreSQL: the network, a timeout, a cancel) may have
// ended the connection: a connection exception (class 08) or one of the
// errors PostgreSQL ends a session with (57P01-57P05: terminated by an
// administrator, a crash, shutdown, a dropped database, an idle session's
// timeout; 25P03 an idle transaction's). pgx reports a terminated backend
// as its FATAL error and finds the connection closed only at the next
// statement.
func connectionLost(state string) bool {
	return state == "" || strings.HasPrefix(state, "08") || strings.HasPrefix(state, "57P") || state == "25P03"
}

func (c *pinnedConn) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	res, err := c.q.ExecContext(ctx, query, args...)
	c.note(err)
	return res, err
}

func (c *pinnedConn) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	rows, err := c.q.QueryContext(ctx, query, args...)
	c.note(err)
	return rows, err
}

func (c *pinnedConn) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return c.q.QueryRowContext(ctx, query, args...)
}

// errInvalid is what valid's Raw callback returns for a broken connection.
var errInvalid = errors.New("connection not valid")

// valid reports whether the driver still considers the connection usable
// (driver.Validator, which lib/pq and pgx's stdlib implement; a driver
// without it is trusted): a connection lost while its rows were read fails
// no call of c, and is caught here instead.
func (c *pinnedConn) valid() bool {
	err := c.conn.Raw(func(dc any) error {
		if v, ok := dc.(driver.Validator); ok && !v.IsValid() {
			return errInvalid
		}
		return nil
	})
	return err == nil
}

// release closes c's statements and gives its connection back to the pool.
func (c *pinnedConn) release() {
	if c.prepared != nil {
		_ = c.prepared.Close()
	}
	_ = c.conn.Close()
}

// pinnedKey is the context key of the pinned connection a caller took.
type pinnedKey struct{}

// withPinned returns ctx carrying c (nil: ctx as it is), for the
// statements run through routed.
func withPinned(ctx context.Context, c *pinnedConn) context.Context {
	if c == nil {
		return ctx
	}
	return context.WithValue(ctx, pinnedKey{}, c)
}

// routed is the relay's fencing.DBTX (env.q): a statement runs on the
// pinned connection its context carries (withPinned), else on pool. One
// DBTX for both, so a wrapper of it (export_test.go's WrapStatements) sees
// every statement.
type routed struct{ pool fencing.DBTX }

var _ fencing.DBTX = routed{}

func (r routed) on(ctx context.Context) fencing.DBTX {
	if c, ok := ctx.Value(pinnedKey{}).(*pinnedConn); ok {
		return c
	}
	return r.pool
}

func (r routed) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return r.on(ctx).ExecContext(ctx, query, args...)
}

func (r routed) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return r.on(ctx).QueryContext(ctx, query, args...)
}

func (r routed) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return r.on(ctx).QueryRowContext(ctx, query, args...)
}
