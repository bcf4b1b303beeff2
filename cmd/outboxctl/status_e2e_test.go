package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }

func (nopPublisher) Close() error { return nil }

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

func TestStatusHumanAndJSON(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedStatus(t, s)

	r := db(t, s, "status")
	requireCode(t, r, 0)
	for _, want := range []string{
		"relay mode:   POLLING",
		"unpublished:  5",
		"in transit:   3 (PENDING, IN_FLIGHT, AMBIGUOUS), oldest 2h0m",
		"failed:       1",
		"exhausted:    1",
		"ambiguous:    1",
		"BACKLOG", "TOP FAILURE CODES", "STUCK CORRELATIONS", "LIVE RELAYS",
		"relay-a",
	} {
		require.Contains(t, r.stdout, want)
	}
	// Aligned columns: the header and a data row line up.
	require.Regexp(t, `(?m)^STATUS\s+DESTINATION\s+TENANT\s+COUNT\s+OLDEST$`, r.stdout)
	require.Regexp(t, `(?m)^PENDING\s+orders\s+acme\s+1\s+\d{4}-`, r.stdout)
	require.Regexp(t, `(?m)^FAILED\s+REJECTED\s+1$`, r.stdout)
	require.Regexp(t, `(?m)^flow-slow\s+0\s+1\s+`, r.stdout)
	require.Regexp(t, `(?m)^flow-park\s+1\s+0\s+`, r.stdout)
	require.NotContains(t, r.stdout, "flow-ok")

	r = db(t, s, "--json", "status", "--stuck-after", "1h")
	requireCode(t, r, 0)
	var snap struct {
		RelayMode    string  `json:"relay_mode"`
		Unpublished  int64   `json:"unpublished"`
		Pending      int64   `json:"pending"`
		Failed       int64   `json:"failed"`
		Exhausted    int64   `json:"exhausted"`
		Ambiguous    int64   `json:"ambiguous"`
		OldestAge    float64 `json:"oldest_pending_age_seconds"`
		FailureCodes []struct {
			Status, Code string
			Count        int64
		} `json:"failure_codes"`
		Stuck []struct {
			CorrelationID string `json:"correlation_id"`
		} `json:"stuck_correlations"`
		Relays []struct {
			Owner string `json:"owner"`
		} `json:"live_relays"`
		ByTenant []struct {
			Key   string
			Count int64
		} `json:"by_tenant"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &snap), r.stdout)
	require.Equal(t, "POLLING", snap.RelayMode)
	require.EqualValues(t, 5, snap.Unpublished)
	require.EqualValues(t, 3, snap.Pending)
	require.EqualValues(t, 1, snap.Failed)
	require.EqualValues(t, 1, snap.Exhausted)
	require.EqualValues(t, 1, snap.Ambiguous)
	require.InDelta(t, 7200, snap.OldestAge, 120)
	var codes []string
	for _, f := range snap.FailureCodes {
		codes = append(codes, fmt.Sprintf("%s/%s=%d", f.Status, f.Code, f.Count))
	}
	require.Equal(t, []string{"AMBIGUOUS/PUBLISH_TIMEOUT=1", "EXHAUSTED/PUBLISH_TIMEOUT=1", "FAILED/REJECTED=1"}, codes)
	require.Len(t, snap.Stuck, 2)
	require.Equal(t, "flow-slow", snap.Stuck[0].CorrelationID)
	require.Equal(t, "flow-park", snap.Stuck[1].CorrelationID)
	require.Len(t, snap.Relays, 1)
	require.Equal(t, "", snap.ByTenant[0].Key) // rows without a tenant: p2, e1, a1
	require.EqualValues(t, 3, snap.ByTenant[0].Count)
	require.Equal(t, "acme", snap.ByTenant[1].Key)

	// A bad flag value is a usage error.
	requireCode(t, db(t, s, "status", "--max-groups", "-1"), 2)
}

// README: each relay's MaxAttempts decides, and `outboxctl status` lists the
// live relays' budgets and warns when they differ.
func TestStatusWarnsWhenRelayBudgetsDiffer(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	ctx := context.Background()
	require.NoError(t, relaymode.BeatBudget(ctx, s.DB, "relay-a", time.Minute, 25))
	r := db(t, s, "status")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^relay-a\s+.*\s25$`, r.stdout)
	require.NotContains(t, r.stdout, "different MaxAttempts")

	require.NoError(t, relaymode.BeatBudget(ctx, s.DB, "relay-b", time.Minute, 3))
	r = db(t, s, "status")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^relay-b\s+.*\s3$`, r.stdout)
	require.Contains(t, r.stdout, "warning: live relays have different MaxAttempts")
	r = db(t, s, "--json", "status")
	requireCode(t, r, 0)
	var doc map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &doc))
	require.Equal(t, true, doc["budgets_differ"])
}

// A list status cuts says how many more there are.
func TestStatusSaysHowManyMoreStuck(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	var rows []testdb.OutboxRow
	for g := 1; g <= 25; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "p-" + strconv.Itoa(g), Destination: "orders", Payload: []byte("x"),
			Status: envelope.StatusFailed, LastFailureCode: "X", CorrelationID: "flow-" + strconv.Itoa(g)}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	r := db(t, s, "status")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "... and 5 more (--max-stuck shows more)\n")
	r = db(t, s, "status", "--max-stuck", "25")
	requireCode(t, r, 0)
	require.NotContains(t, r.stdout, "more (--max-stuck")
	r = db(t, s, "--json", "status", "--max-stuck", "3")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, `"stuck_total": 25`)
}
