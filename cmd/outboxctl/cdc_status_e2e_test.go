package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// `outboxctl status` shows each slot's lag and wal_status, in text and JSON,
// while its relay runs and after it stopped (issue 20 item 5).
func TestStatusShowsSlotLagForARunningAndAStoppedRelay(t *testing.T) {
	base := testdb.Logical(t)
	s := testdb.NewOn(t, base)
	ctx := context.Background()
	slot := "cli_" + strings.TrimPrefix(s.Name, "outbox_test_")
	t.Cleanup(func() {
		_, _ = s.DB.Exec(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, slot)
	})
	require.NoError(t, relaymode.Enable(ctx, s.DB, "test", time.Time{}))
	r, err := cdcrelay.New(cdcrelay.Config{
		ConnString: testdb.ReplicationURL(base), DB: s.DB, Schema: s.Name, SlotName: slot, PublicationName: "pub_" + slot,
		CreateSlot: true, CreatePublication: true,
	}, nopPublisher{}, nil)
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx) }()
	t.Cleanup(func() { _ = r.Close() })

	type slotJSON struct {
		Name              string `json:"slot_name"`
		Active            bool   `json:"active"`
		WALStatus         string `json:"wal_status"`
		RetainedWALBytes  *int64 `json:"retained_wal_bytes"`
		ConfirmedLagBytes *int64 `json:"confirmed_lag_bytes"`
		SafeWALSizeBytes  *int64 `json:"safe_wal_size_bytes"`
		OlderUndelivered  *int64 `json:"undelivered_before_slot"`
	}
	readJSON := func() (slots []slotJSON, consumers int) {
		res := db(t, s, "--json", "status")
		requireCode(t, res, 0)
		var out struct {
			Slots     []slotJSON        `json:"replication_slots"`
			Consumers []json.RawMessage `json:"cdc_consumers"`
		}
		require.NoError(t, json.Unmarshal([]byte(res.stdout), &out), res.stdout)
		return out.Slots, len(out.Consumers)
	}

	require.Eventually(t, func() bool {
		slots, consumers := readJSON()
		// The walsender creating the slot holds it too; the boundary is
		// recorded once it exists.
		return len(slots) == 1 && slots[0].Active && consumers == 1 && slots[0].OlderUndelivered != nil
	}, 30*time.Second, 20*time.Millisecond, "the running relay's slot is active and its heartbeat listed")
	slots, _ := readJSON()
	require.Equal(t, slot, slots[0].Name)
	require.Equal(t, "reserved", slots[0].WALStatus)
	require.NotNil(t, slots[0].RetainedWALBytes)
	require.NotNil(t, slots[0].ConfirmedLagBytes)
	res := db(t, s, "status")
	requireCode(t, res, 0)
	require.Contains(t, res.stdout, "REPLICATION SLOTS")
	require.Regexp(t, `(?m)^`+slot+`\s+true\s+reserved\s+\d`, res.stdout)
	require.Regexp(t, `(?m)^cdcrelay@\S+\s+`+slot+`\s`, res.stdout)

	require.NoError(t, r.Close())
	require.NoError(t, <-errc)
	_, err = s.DB.Exec(`SELECT pg_logical_emit_message(true, 'cli-test', repeat('x', 100000))`)
	require.NoError(t, err)
	slots, consumers := readJSON()
	require.Len(t, slots, 1)
	require.False(t, slots[0].Active)
	require.Equal(t, "reserved", slots[0].WALStatus)
	require.Greater(t, *slots[0].ConfirmedLagBytes, int64(1000), "WAL written after the relay stopped is unconfirmed")
	require.Zero(t, consumers)
	res = db(t, s, "status")
	requireCode(t, res, 0)
	require.Regexp(t, `(?m)^`+slot+`\s+false\s+reserved\s+\d+(\.\d)? \S+`, res.stdout)
	require.Regexp(t, `(?m)^`+slot+`\s.*\s+unlimited\s+0$`, res.stdout, "safe_wal_size without max_slot_wal_keep_size; no undelivered row older than the slot")
}
