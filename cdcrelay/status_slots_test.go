package cdcrelay_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/status"
)

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

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
	}, patience(t), 10*time.Millisecond, "the relay created the slot, recorded its boundary and streams")
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
	}, patience(t), 10*time.Millisecond, "the stopped relay's walsender released the slot")
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
