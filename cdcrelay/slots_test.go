package cdcrelay_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/status"
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
	require.Eventually(t, func() bool { return len(out.ids()) == 1 }, await.Patience(t), 10*time.Millisecond)
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
	}, await.Patience(t), 10*time.Millisecond, "the slot is invalidated")

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
	}, await.Patience(t), 10*time.Millisecond, "the walsender of the refused stream releases the slot")
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
	require.Eventually(t, func() bool { return len(out.ids()) == 5 }, await.Patience(t), 10*time.Millisecond)
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
	require.Eventually(t, func() bool { return len(out.ids()) == 2 }, await.Patience(t), 10*time.Millisecond)
	require.Equal(t, []string{"backlog", "next"}, out.ids())
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
	require.Eventually(t, func() bool { return len(log.lagWarnings()) > 0 }, await.Patience(t), 10*time.Millisecond)
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
	require.Eventually(t, func() bool { return e.s.Count(t, "status = 'PUBLISHED'") == 1 }, await.Patience(t), 10*time.Millisecond)
	require.NoError(t, wait())
	require.Empty(t, quiet.lagWarnings())
}

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }

func (discard) Close() error { return nil }

func slotOf(t *testing.T, snap status.Snapshot, name string) status.Slot {
	t.Helper()
	for _, sl := range snap.Slots {
		if sl.Name == name {
			return sl
		}
	}
	t.Fatalf("slot %s not in %+v", name, snap.Slots)
	return status.Slot{}
}

func gauge(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// Issue 20 item 5: nothing reported a slot's retained WAL, confirmed lag,
// wal_status or safe_wal_size, and a second CDC consumer went unnoticed.
func TestSlotLagForARunningAndAStoppedRelay(t *testing.T) {
	base := testdb.Logical(t)
	s := testdb.NewOn(t, base)
	ctx := context.Background()
	slot := "st_" + strings.TrimPrefix(s.Name, "outbox_test_")
	t.Cleanup(func() {
		_, _ = s.DB.Exec(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, slot)
	})
	require.NoError(t, relaymode.Enable(ctx, s.DB, "test", time.Time{}))
	r, err := cdcrelay.New(cdcrelay.Config{
		ConnString: testdb.ReplicationURL(base), DB: s.DB, Schema: s.Name, SlotName: slot, PublicationName: "pub_" + slot,
		CreateSlot: true, CreatePublication: true, StandbyTimeout: 200 * time.Millisecond,
	}, discard{}, nil)
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			require.NoError(t, r.Close())
			require.NoError(t, <-errc)
		}
	}
	t.Cleanup(stop)

	// Running: the slot is active, reserved, and its consumer is listed.
	var snap status.Snapshot
	require.Eventually(t, func() bool {
		snap, err = status.Collect(ctx, s.DB)
		require.NoError(t, err)
		// Active alone is not enough: the walsender creating the slot holds
		// it too; the boundary is recorded once the slot exists.
		return len(snap.Slots) == 1 && snap.Slots[0].Active && len(snap.CDCConsumers) == 1 && snap.Slots[0].UndeliveredBeforeSlot != nil
	}, await.Patience(t), 10*time.Millisecond, "the relay created the slot, recorded its boundary and streams")
	running := slotOf(t, snap, slot)
	require.Equal(t, "pgoutput", running.Plugin)
	require.Equal(t, "reserved", running.WALStatus)
	require.Nil(t, running.SafeWALSizeBytes, "max_slot_wal_keep_size is -1 on this cluster: no limit")
	require.Zero(t, *running.UndeliveredBeforeSlot)
	require.Equal(t, slot, snap.CDCConsumers[0].SlotName)
	require.Empty(t, snap.Warnings)

	// Stopped: WAL written since is retained and unconfirmed.
	stop()
	for i := range 20 {
		err := publisher.InTx(ctx, s.DB, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
			payload := make([]byte, 10000)
			_, _ = rand.Read(payload) // incompressible: 10 kB of WAL each
			return pub.Publish("orders", message.NewMessage(fmt.Sprintf("lag-%d", i), payload))
		})
		require.NoError(t, err)
	}
	// The server's walsender lets go of the slot once it sees the stream
	// end, which may be a moment after Close returns.
	require.Eventually(t, func() bool {
		snap, err = status.Collect(ctx, s.DB)
		require.NoError(t, err)
		return !slotOf(t, snap, slot).Active
	}, await.Patience(t), 10*time.Millisecond, "the stopped relay's walsender released the slot")
	down := slotOf(t, snap, slot)
	require.Equal(t, "reserved", down.WALStatus)
	require.Greater(t, down.ConfirmedLagBytes, int64(200000), "20 rows of 10 kB were written after the relay stopped")
	require.GreaterOrEqual(t, down.RetainedWALBytes, down.ConfirmedLagBytes)
	require.Empty(t, snap.CDCConsumers, "the stopped relay removed its heartbeat")

	// A connector on another slot, through its heartbeat action query, and
	// a native relay's heartbeat on this one: reported.
	require.NoError(t, relaymode.BeatCDC(ctx, s.DB, "native", slot, time.Minute))
	require.NoError(t, status.CheckOneCDCConsumer(ctx, s.DB), "one consumer: ready")
	q, err := debezium.HeartbeatActionQuery(debezium.Options{Schema: s.Name, SlotName: "other_slot"})
	require.NoError(t, err)
	_, err = s.DB.Exec(q) // a connector cannot be refused: it is reported
	require.NoError(t, err)
	snap, err = status.Collect(ctx, s.DB)
	require.NoError(t, err)
	require.Len(t, snap.CDCConsumers, 2)
	require.Len(t, snap.Warnings, 1)
	require.Contains(t, snap.Warnings[0], "2 CDC consumers stream from 2 different slots")
	err = status.CheckOneCDCConsumer(ctx, s.DB)
	require.ErrorIs(t, err, relaymode.ErrSecondCDCConsumer, "the readiness check reports the second consumer")
	require.Contains(t, err.Error(), "slot other_slot (debezium:messaging-outbox)")

	// The same numbers as gauges.
	c, err := status.NewCollector(s.DB, status.CollectorOptions{})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP outbox_cdc_consumer_slots Distinct replication slots among the live CDC consumers; above 1 every insert is delivered more than once.
# TYPE outbox_cdc_consumer_slots gauge
outbox_cdc_consumer_slots 2
# HELP outbox_cdc_consumers CDC consumers (native relays, Debezium connectors) with a live heartbeat.
# TYPE outbox_cdc_consumers gauge
outbox_cdc_consumers 2
# HELP outbox_cdc_slot_active 1 while a consumer streams from the slot.
# TYPE outbox_cdc_slot_active gauge
outbox_cdc_slot_active{slot="`+slot+`"} 0
# HELP outbox_cdc_slot_wal_status 1 for the slot's wal_status (reserved, extended, unreserved, lost), 0 for the others.
# TYPE outbox_cdc_slot_wal_status gauge
outbox_cdc_slot_wal_status{slot="`+slot+`",wal_status="extended"} 0
outbox_cdc_slot_wal_status{slot="`+slot+`",wal_status="lost"} 0
outbox_cdc_slot_wal_status{slot="`+slot+`",wal_status="reserved"} 1
outbox_cdc_slot_wal_status{slot="`+slot+`",wal_status="unreserved"} 0
`), "outbox_cdc_consumer_slots", "outbox_cdc_consumers", "outbox_cdc_slot_active", "outbox_cdc_slot_wal_status"))
	retained, ok := gauge(t, reg, "outbox_cdc_slot_retained_wal_bytes", map[string]string{"slot": slot})
	require.True(t, ok)
	require.GreaterOrEqual(t, retained, float64(down.ConfirmedLagBytes))
	lag, ok := gauge(t, reg, "outbox_cdc_slot_confirmed_lag_bytes", map[string]string{"slot": slot})
	require.True(t, ok)
	require.GreaterOrEqual(t, lag, float64(down.ConfirmedLagBytes))
	_, ok = gauge(t, reg, "outbox_cdc_slot_safe_wal_size_bytes", map[string]string{"slot": slot})
	require.False(t, ok, "no safe_wal_size without max_slot_wal_keep_size")
}
