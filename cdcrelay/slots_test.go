package cdcrelay_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func controllable(t *testing.T) *testdb.Cluster {
	t.Helper()
	return testdb.ControllableLogicalCluster(t)
}

func (e *env) walStatus(t *testing.T) string {
	t.Helper()
	var s string
	require.NoError(t, e.s.DB.QueryRow(`SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&s))
	return s
}

// TestLostSlotIsAnErrorAndNotSilentlyRecreated is issue 20 item 3. On the old
// code Run returned "start replication on slot ...: ERROR: cannot read from
// logical replication slot (SQLSTATE 55000)" with no code and without
// PostgreSQL's DETAIL, and a recreated slot streamed on while the rows
// committed before it were never delivered.
func TestLostSlotIsAnErrorAndNotSilentlyRecreated(t *testing.T) {
	c := controllable(t)
	require.NoError(t, c.Exec(`ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'`))
	require.NoError(t, c.Exec(`SELECT pg_reload_conf()`))
	e := newEnv(t, c.URL)
	e.enableCDC(t)
	ctx := context.Background()
	out := &recorder{}
	wait := e.relay(t, e.config(), out)
	e.publish(t, "orders", msg("streamed", "s", nil))
	require.Eventually(t, func() bool { return len(out.ids()) == 1 }, patience(t), 10*time.Millisecond)
	require.NoError(t, wait())

	// Rows committed while the relay is down, then WAL past the slot's
	// reserve: the checkpoint invalidates the slot and its WAL is removed.
	for i := range 3 {
		e.publish(t, "orders", msg(fmt.Sprintf("lost-%d", i), "l", nil))
	}
	require.Eventually(t, func() bool {
		for range 3 {
			_, err := e.s.DB.Exec(`SELECT pg_logical_emit_message(false, 'cdcrelay-test', repeat('x', 1000)), pg_switch_wal()`)
			require.NoError(t, err)
		}
		_, err := e.s.DB.Exec(`CHECKPOINT`)
		require.NoError(t, err)
		return e.walStatus(t) == "lost"
	}, patience(t), 10*time.Millisecond, "the slot is invalidated")

	r, err := cdcrelay.New(e.config(), out, nil)
	require.NoError(t, err)
	err = r.Run(ctx)
	require.ErrorIs(t, err, cdcrelay.ErrSlotLost)
	require.Equal(t, outbox.Code("CDC_SLOT_LOST"), outbox.CodeOf(err))
	require.Contains(t, err.Error(), `wal_status "lost"`)
	// PostgreSQL's DETAIL is kept. Its wording depends on the major: up to 17
	// "This slot has been invalidated because it exceeded the maximum
	// reserved size.", from 18 on "This replication slot has been
	// invalidated due to "wal_removed"."
	require.Regexp(t, `exceeded the maximum reserved size|invalidated due to "wal_removed"`, err.Error(), "PostgreSQL's DETAIL is kept")
	t.Logf("Run returned: %v", err)

	// The natural fix, dropping the slot and letting the relay create it, is
	// refused: the rows committed while it was down are not in a new slot.
	// The server's walsender of the refused stream ends on its own after Run
	// returned, and the slot cannot be dropped while it is still active
	// (seen once on a loaded machine: "replication slot ... is active for
	// PID ...").
	require.Eventually(t, func() bool {
		var active bool
		err := e.s.DB.QueryRow(`SELECT active FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&active)
		return err == nil && !active
	}, patience(t), 10*time.Millisecond, "the walsender of the refused stream releases the slot")
	_, err = e.s.DB.Exec(`SELECT pg_drop_replication_slot($1)`, e.slot)
	require.NoError(t, err)
	r, err = cdcrelay.New(e.config(), out, nil)
	require.NoError(t, err)
	err = r.Run(ctx)
	require.ErrorIs(t, err, cdcrelay.ErrUndeliveredRows)
	require.Contains(t, err.Error(), "3 undelivered row(s)")
	var slots int
	require.NoError(t, e.s.DB.QueryRow(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&slots))
	require.Zero(t, slots, "the refused slot is not left behind")
	require.Equal(t, []string{"streamed"}, out.ids())

	// The documented recovery: back to POLLING, the forwarders deliver the
	// rows, the slot is prepared, then CDC again.
	require.NoError(t, relaymode.Disable(ctx, e.s.DB, "ops"))
	fw, err := forwarder.New(e.s.DB, out, nil, forwarder.Config{Owner: "drain"})
	require.NoError(t, err)
	rep, err := fw.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, rep.Published)
	require.NoError(t, fw.Close())
	r, err = cdcrelay.New(e.config(), out, nil)
	require.NoError(t, err)
	require.NoError(t, r.Prepare(ctx))
	n, known, err := cdcrelay.UndeliveredBeforeSlot(ctx, e.s.DB, e.slot)
	require.NoError(t, err)
	require.True(t, known)
	require.Zero(t, n)
	require.NoError(t, relaymode.Enable(ctx, e.s.DB, "ops", time.Time{}))
	wait = e.streaming(t, r)
	e.publish(t, "orders", msg("after", "a", nil))
	require.Eventually(t, func() bool { return len(out.ids()) == 5 }, patience(t), 10*time.Millisecond)
	// Every row once (the forwarder publishes concurrently: the drained
	// rows in any order).
	require.ElementsMatch(t, []string{"streamed", "lost-0", "lost-1", "lost-2", "after"}, out.ids())
	require.Equal(t, "after", out.ids()[4])
	require.NoError(t, wait())
}

// TestUndeliveredRowsBeforeAPreparedSlotAreRefused: a slot prepared while the
// forwarders run, with rows they have not delivered when they stop, is
// refused at Run until those rows are delivered.
func TestUndeliveredRowsBeforeAPreparedSlotAreRefused(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	ctx := context.Background()
	e.publish(t, "orders", msg("backlog", "b", nil))
	out := &recorder{}
	r, err := cdcrelay.New(e.config(), out, nil)
	require.NoError(t, err)
	require.NoError(t, r.Prepare(ctx))
	n, known, err := cdcrelay.UndeliveredBeforeSlot(ctx, e.s.DB, e.slot)
	require.NoError(t, err)
	require.True(t, known)
	require.EqualValues(t, 1, n)
	e.enableCDC(t) // the forwarders were stopped with the backlog undelivered
	err = r.Run(ctx)
	require.ErrorIs(t, err, cdcrelay.ErrUndeliveredRows)
	require.Empty(t, out.ids())

	require.NoError(t, relaymode.Disable(ctx, e.s.DB, "ops"))
	fw, err := forwarder.New(e.s.DB, out, nil, forwarder.Config{Owner: "drain"})
	require.NoError(t, err)
	rep, err := fw.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)
	require.NoError(t, fw.Close())
	e.enableCDC(t)
	r, err = cdcrelay.New(e.config(), out, nil)
	require.NoError(t, err)
	wait := e.streaming(t, r)
	e.publish(t, "orders", msg("next", "n", nil))
	require.Eventually(t, func() bool { return len(out.ids()) == 2 }, patience(t), 10*time.Millisecond)
	require.Equal(t, []string{"backlog", "next"}, out.ids())
	require.NoError(t, wait())
}

// TestFastShutdownIsNotBlockedByARefusingDownstream is issue 20 item 4. On the
// old code the relay retried with its walsender open and never confirmed the
// end of the WAL, so `pg_ctl stop -m fast` failed with "server does not shut
// down" until the downstream recovered.
func TestFastShutdownIsNotBlockedByARefusingDownstream(t *testing.T) {
	c := controllable(t)
	e := newEnv(t, c.URL)
	e.enableCDC(t)
	cfg := e.config()
	cfg.RetryInitial, cfg.RetryMax = 50*time.Millisecond, 200*time.Millisecond
	var down atomic.Bool
	down.Store(true)
	out := &recorder{refuse: func(_ string, _ *message.Message) error {
		if down.Load() {
			return errors.New("downstream outage")
		}
		return nil
	}}
	r, err := cdcrelay.New(cfg, out, nil)
	require.NoError(t, err)
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	t.Cleanup(func() { _ = r.Close() })
	require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, patience(t), 10*time.Millisecond)
	e.publish(t, "orders", msg("held", "h", nil))
	require.Eventually(t, func() bool { return out.attemptsOf("held") >= 3 }, patience(t), 10*time.Millisecond, "the relay is retrying")

	start := time.Now()
	require.NoError(t, c.Stop("fast", 30*time.Second), "a fast shutdown during the outage")
	t.Logf("fast shutdown took %s", time.Since(start))
	select {
	case err := <-runErr:
		require.Error(t, err, "the server is gone")
		require.Empty(t, outbox.CodeOf(err), "a connection failure, not a refusal: %v", err)
	case <-time.After(patience(t)):
		t.Fatal("Run did not return after the server stopped")
	}

	// Server and downstream back: the message is delivered once.
	require.NoError(t, c.Start())
	down.Store(false)
	r2, err := cdcrelay.New(cfg, out, nil)
	require.NoError(t, err)
	wait := running(t, r2)
	require.Eventually(t, func() bool { return len(out.ids()) == 1 }, patience(t), 10*time.Millisecond)
	require.Equal(t, []string{"held"}, out.ids())
	require.NoError(t, wait())
}

// capture is a logger that keeps the error lines.
type capture struct {
	mu    sync.Mutex
	lines []captured
}

type captured struct {
	msg    string
	err    error
	fields watermill.LogFields
}

func (c *capture) Error(msg string, err error, fields watermill.LogFields) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lines = append(c.lines, captured{msg, err, fields})
}
func (c *capture) Info(string, watermill.LogFields)                 {}
func (c *capture) Debug(string, watermill.LogFields)                {}
func (c *capture) Trace(string, watermill.LogFields)                {}
func (c *capture) With(watermill.LogFields) watermill.LoggerAdapter { return c }

func (c *capture) lagWarnings() []captured {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []captured
	for _, l := range c.lines {
		if errors.Is(l.err, cdcrelay.ErrSlotLagging) {
			out = append(out, l)
		}
	}
	return out
}

// Issue 20 item 5: the relay logs a warning when its slot retains more WAL
// than LagWarnBytes (checked with its heartbeat); the old relay never read
// its slot's lag.
func TestRelayWarnsPastTheLagThreshold(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	e.enableCDC(t)
	cfg := e.config()
	cfg.HeartbeatInterval, cfg.HeartbeatTTL = 50*time.Millisecond, 5*time.Second
	cfg.LagWarnBytes, cfg.LagWarnEvery = 1, time.Hour // any retained WAL; once
	log := &capture{}
	r, err := cdcrelay.New(cfg, &recorder{}, log)
	require.NoError(t, err)
	wait := e.streaming(t, r)
	_, err = e.s.DB.Exec(`SELECT pg_logical_emit_message(true, 'lag-test', repeat('x', 10000))`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(log.lagWarnings()) > 0 }, patience(t), 10*time.Millisecond)
	w := log.lagWarnings()[0]
	require.Equal(t, e.slot, w.fields["slot"])
	require.Equal(t, "reserved", w.fields["wal_status"])
	require.Positive(t, w.fields["retained_wal_bytes"].(int64))
	require.EqualValues(t, 1, w.fields["threshold_bytes"])
	require.NoError(t, wait())
	require.Len(t, log.lagWarnings(), 1, "at most one per LagWarnEvery")

	cfg.LagWarnBytes = -1 // disabled
	quiet := &capture{}
	r, err = cdcrelay.New(cfg, &recorder{}, quiet)
	require.NoError(t, err)
	wait = e.streaming(t, r)
	e.publish(t, "orders", msg("m", "m", nil))
	require.Eventually(t, func() bool { return e.s.Count(t, "status = 'PUBLISHED'") == 1 }, patience(t), 10*time.Millisecond)
	require.NoError(t, wait())
	require.Empty(t, quiet.lagWarnings())
}
