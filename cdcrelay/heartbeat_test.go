package cdcrelay_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/internal/pgerr"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// How the tests below make the relay's heartbeat writes fail for real: the
// relay's pool has a lock_timeout, and another transaction holds the row
// lock on the relay's heartbeat row, so each renewal (relaymode.BeatCDC's
// INSERT ... ON CONFLICT DO UPDATE) fails with 55P03 lock_not_available
// while the rest of the database, the outbox included, stays usable.
const heartbeatLockTimeout = "100ms"

// relayPool opens a pool on e's schema whose sessions give up a lock wait
// after heartbeatLockTimeout.
func relayPool(t *testing.T, e *env) *sql.DB {
	t.Helper()
	u := e.s.URL
	if p, err := url.Parse(u); err == nil && p.Scheme != "" {
		q := p.Query()
		q.Set("lock_timeout", heartbeatLockTimeout)
		p.RawQuery = q.Encode()
		u = p.String()
	} else {
		u += " lock_timeout=" + heartbeatLockTimeout
	}
	db, err := testdb.OpenURL(u)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	var lt string
	require.NoError(t, db.QueryRow(`SHOW lock_timeout`).Scan(&lt))
	require.Equal(t, heartbeatLockTimeout, lt)
	return db
}

// holdHeartbeat locks owner's heartbeat row in a transaction of its own
// until release is called (also at cleanup): the relay's renewals fail.
func holdHeartbeat(t *testing.T, e *env, owner string) (release func()) {
	t.Helper()
	tx, err := e.s.DB.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback() }) }
	t.Cleanup(release)
	var got string
	require.NoError(t, tx.QueryRow(`SELECT owner FROM messaging_relay_heartbeat WHERE owner = $1 FOR UPDATE`, owner).Scan(&got))
	return release
}

// cutOrRefused reports whether err is a heartbeat write that failed on the
// held lock (lock_timeout) or was cut by the relay's bound on it: cancelled
// by the server (lib/pq sends a cancel request) or by the client (pgx).
func cutOrRefused(err error) bool {
	s := pgerr.State(err)
	return s == pgerr.LockNotAvailable || s == pgerr.QueryCanceled || errors.Is(err, context.DeadlineExceeded)
}

// heartbeatExpired reports whether owner's last successful heartbeat has
// expired by the database's clock (a plain read: the row lock does not
// block it). Its expires_at is the beat's transaction time + HeartbeatTTL,
// and the relay measures the heartbeat's age from before that transaction
// began, so once this is true the relay's own count is past HeartbeatTTL too.
func heartbeatExpired(t *testing.T, e *env, owner string) bool {
	t.Helper()
	var expired bool
	require.NoError(t, e.s.DB.QueryRow(`SELECT expires_at <= now() FROM messaging_relay_heartbeat WHERE owner = $1`, owner).Scan(&expired))
	return expired
}

// gate is a downstream that blocks the publish of one message until it is
// opened, and records what it accepted.
type gate struct {
	hold    string
	entered chan struct{} // closed when the held message reaches Publish
	open    chan struct{}
	once    sync.Once

	mu       sync.Mutex
	accepted []string
	attempts map[string]int
}

func newGate(hold string) *gate {
	return &gate{hold: hold, entered: make(chan struct{}), open: make(chan struct{}), attempts: map[string]int{}}
}

func (g *gate) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		g.mu.Lock()
		g.attempts[m.UUID]++
		first := m.UUID == g.hold && g.attempts[m.UUID] == 1
		g.mu.Unlock()
		if first {
			close(g.entered)
			<-g.open
		}
		g.mu.Lock()
		g.accepted = append(g.accepted, m.UUID)
		g.mu.Unlock()
	}
	return nil
}

func (g *gate) Close() error { return nil }

func (g *gate) release() { g.once.Do(func() { close(g.open) }) }

func (g *gate) ids() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.accepted...)
}

func (g *gate) attemptsOf(id string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.attempts[id]
}

// heartbeatFailures are the logged heartbeat failures the relay tolerated.
func (c *capture) heartbeatFailures() []captured {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []captured
	for _, l := range c.lines {
		if strings.Contains(l.msg, "heartbeat failed") {
			out = append(out, l)
		}
	}
	return out
}

// runLapsing runs a relay as owner on a fresh environment in CDC mode,
// beating every 50 ms with a lifetime of ttl, publishing to out, on a pool
// with heartbeatLockTimeout when lockTimeout is set (else on the
// environment's own); it returns once the walsender streams. runErr gets
// Run's result.
func runLapsing(t *testing.T, base, owner string, ttl time.Duration, lockTimeout bool, out message.Publisher, logger watermill.LoggerAdapter) (e *env, cfg cdcrelay.Config, runErr chan error) {
	t.Helper()
	e = newEnv(t, base)
	e.enableCDC(t)
	cfg = e.config()
	if lockTimeout {
		cfg.DB = relayPool(t, e)
	}
	cfg.Owner = owner
	cfg.HeartbeatInterval, cfg.HeartbeatTTL = 50*time.Millisecond, ttl
	r, err := cdcrelay.New(cfg, out, logger)
	require.NoError(t, err)
	runErr = make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	t.Cleanup(func() { _ = r.Close() })
	require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, await.Patience(t), 10*time.Millisecond)
	return e, cfg, runErr
}

// docs/ERRORS.md: CDC_HEARTBEAT_LAPSED, returned by cdcrelay: no CDC
// heartbeat succeeded for longer than its lifetime (HeartbeatTTL); the mode
// may have left CDC meanwhile, so the relay stopped before publishing more.
func TestHeartbeatLapseStopsTheRelay(t *testing.T) {
	base := testdb.Logical(t)

	t.Run("heartbeat writes failing for HeartbeatTTL stop a running relay with CDC_HEARTBEAT_LAPSED", func(t *testing.T) {
		logs := &capture{}
		// A lifetime of 3 s: a failure is tolerated only while the last
		// success is younger than it, and a busy machine can stall the
		// relay between two beats for longer than a second.
		e, cfg, runErr := runLapsing(t, base, "cdc-lapse-idle", 3*time.Second, true, &recorder{}, logs)

		release := holdHeartbeat(t, e, cfg.Owner)
		err := receive(t, runErr)
		release()
		require.ErrorIs(t, err, cdcrelay.ErrHeartbeatLapsed)
		require.Equal(t, cdcrelay.CodeHeartbeatLapsed, outbox.CodeOf(err))
		// The last renewal fails on the lock, or is cut by the relay's
		// bound (what was left of the heartbeat's life) first.
		require.True(t, cutOrRefused(err), "the cause is the failed heartbeat write: %v", err)
		// One failed renewal does not stop it: the failures before the
		// lapse were logged and tolerated.
		failures := logs.heartbeatFailures()
		require.NotEmpty(t, failures, "a heartbeat failure within HeartbeatTTL is tolerated")
		require.Equal(t, pgerr.LockNotAvailable, pgerr.State(failures[0].err))
		require.False(t, errors.Is(failures[0].err, cdcrelay.ErrHeartbeatLapsed))
	})

	t.Run("a renewal that blocks is bounded by the heartbeat's lifetime", func(t *testing.T) {
		// No lock_timeout here: the renewal waits on the row lock for as
		// long as it is held, so only the relay's own bound ends it.
		e, cfg, runErr := runLapsing(t, base, "cdc-lapse-blocked", time.Second, false, &recorder{}, nil)

		release := holdHeartbeat(t, e, cfg.Owner)
		defer release()
		err := receive(t, runErr)
		require.ErrorIs(t, err, cdcrelay.ErrHeartbeatLapsed)
		s := pgerr.State(err)
		require.True(t, s == pgerr.QueryCanceled || errors.Is(err, context.DeadlineExceeded), "the renewal was cut by its bound, not refused: %v", err)
	})

	t.Run("a publish that outlives the heartbeat's lifetime is the last one", func(t *testing.T) {
		out := newGate("first")
		e, cfg, runErr := runLapsing(t, base, "cdc-lapse-held", time.Second, true, out, nil)
		t.Cleanup(out.release) // runs before Close: a failed test never leaves Run in Publish

		// One transaction of two messages; the downstream holds the first.
		e.publish(t, "orders", msg("first", "1", nil), msg("second", "2", nil))
		select {
		case <-out.entered:
		case <-time.After(await.Patience(t)):
			t.Fatal("the relay never published the first message")
		}
		// While the first publish is in the downstream, heartbeat writes
		// fail and the last successful heartbeat expires.
		release := holdHeartbeat(t, e, cfg.Owner)
		require.Eventually(t, func() bool { return heartbeatExpired(t, e, cfg.Owner) }, await.Patience(t), 10*time.Millisecond)
		out.release()

		err := receive(t, runErr)
		release()
		require.ErrorIs(t, err, cdcrelay.ErrHeartbeatLapsed)
		// The renewal after the publish fails on the lock, or is cut by its
		// bound first (the heartbeat has expired: HeartbeatInterval is all
		// it gets, less than the lock_timeout).
		require.True(t, cutOrRefused(err), "the cause is the failed heartbeat write: %v", err)
		require.Equal(t, []string{"first"}, out.ids(), "the publish in the downstream was finished")
		require.Zero(t, out.attemptsOf("second"), "nothing was published after the heartbeat lapsed")
		require.Equal(t, 1, e.s.Count(t, "message_id = 'first' AND status = 'PUBLISHED'"), "what it published is marked")
		require.Equal(t, 1, e.s.Count(t, "message_id = 'second' AND status = 'PENDING' AND published_at IS NULL"))

		// The transaction was not confirmed: a relay whose heartbeat works
		// delivers the rest, and not the first again.
		cfg.DB = e.s.DB
		wait := e.relay(t, cfg, out)
		require.Eventually(t, func() bool { return len(out.ids()) == 2 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"first", "second"}, out.ids())
		require.Equal(t, 1, out.attemptsOf("first"))
		require.NoError(t, wait())
	})
}

// TestBothRelaysHeartbeatWithTheirKind is issue 18's "both relays beat": a
// running polling forwarder holds a POLLING heartbeat, which blocks the switch
// to CDC; a running CDC relay holds a CDC heartbeat on its slot, renews it
// while it runs (idle: no row to publish), and Disable refuses while it is
// live, naming it. Each relay removes its heartbeat when it stops.
func TestBothRelaysHeartbeatWithTheirKind(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	ctx := context.Background()

	stop := startForwarder(t, e.s.DB, &recorder{}, "fw-kind")
	var polling []relaymode.Heartbeat
	require.Eventually(t, func() bool {
		var err error
		polling, err = relaymode.LiveRelays(ctx, e.s.DB, time.Time{})
		require.NoError(t, err)
		return len(polling) == 1
	}, await.Patience(t), 10*time.Millisecond)
	require.Equal(t, "fw-kind", polling[0].Owner)
	require.Equal(t, relaymode.ModePolling, polling[0].Kind)
	require.Empty(t, polling[0].SlotName)
	err := relaymode.Enable(ctx, e.s.DB, "test", time.Time{})
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "Enable refuses while a polling relay beats")
	require.Contains(t, err.Error(), "fw-kind")

	stop()
	polling, err = relaymode.LiveRelays(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, polling, "a stopped forwarder removes its heartbeat")
	e.enableCDC(t)

	cfg := e.config()
	cfg.Owner = "cdc-kind"
	cfg.HeartbeatInterval, cfg.HeartbeatTTL = 50*time.Millisecond, 10*time.Second
	wait := e.relay(t, cfg, &recorder{})
	cdc, err := relaymode.LiveCDCConsumers(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Len(t, cdc, 1)
	require.Equal(t, "cdc-kind", cdc[0].Owner)
	require.Equal(t, relaymode.ModeCDC, cdc[0].Kind)
	require.Equal(t, e.slot, cdc[0].SlotName)
	polling, err = relaymode.LiveRelays(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, polling, "a CDC heartbeat is not a polling one")

	first := cdc[0].HeartbeatAt
	require.Eventually(t, func() bool {
		live, err := relaymode.LiveCDCConsumers(ctx, e.s.DB, time.Time{})
		require.NoError(t, err)
		return len(live) == 1 && live[0].HeartbeatAt.After(first)
	}, await.Patience(t), 10*time.Millisecond, "the idle CDC relay renews its heartbeat while it runs")

	err = relaymode.Disable(ctx, e.s.DB, "test")
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "Disable refuses while the CDC relay beats")
	require.Contains(t, err.Error(), "cdc-kind")
	mode, err := relaymode.CurrentMode(ctx, e.s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModeCDC, mode)

	require.NoError(t, wait())
	cdc, err = relaymode.LiveCDCConsumers(ctx, e.s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, cdc, "a stopped CDC relay removes its heartbeat")
	require.NoError(t, relaymode.Disable(ctx, e.s.DB, "test"))
}
