package status

import (
	"context"
	"database/sql"
	"encoding/json"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// t0 is the pinned "now" of the tests.
var t0 = time.Date(2030, 1, 2, 12, 0, 0, 0, time.UTC)

type seed struct {
	id, dest, status string
	age              time.Duration
	tenant, corr     string
	code             string
}

func insert(t *testing.T, db *sql.DB, rows ...seed) {
	t.Helper()
	for _, r := range rows {
		at := t0.Add(-r.age)
		row := envelope.Row{MessageID: r.id, Destination: r.dest, Payload: []byte("x"), Status: envelope.Status(r.status),
			CreatedAt: at, Tenant: r.tenant, CorrelationID: r.corr, LastFailureCode: r.code}
		if row.Status.Parked() {
			row.ParkedAt = at
		}
		if row.Status == envelope.StatusPublished {
			row.PublishedAt = at
		}
		testdb.InsertRow(t, db, row)
	}
}

func fixture(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	insert(t, s.DB,
		seed{id: "p1", dest: "orders", status: "PENDING", age: time.Minute, tenant: "acme", corr: "c-fresh"},
		seed{id: "p2", dest: "orders", status: "PENDING", age: time.Hour, tenant: "acme", corr: "c-slow"},
		seed{id: "p3", dest: "billing", status: "PENDING", age: 2 * time.Minute},
		seed{id: "i1", dest: "orders", status: "IN_FLIGHT", age: 30 * time.Second, tenant: "globex"},
		seed{id: "a1", dest: "billing", status: "AMBIGUOUS", age: 3 * time.Hour, code: "PUBLISH_TIMEOUT", corr: "c-amb"},
		seed{id: "f1", dest: "orders", status: "FAILED", age: 10 * time.Minute, code: "REJECTED", corr: "c-park", tenant: "acme"},
		seed{id: "f2", dest: "orders", status: "FAILED", age: 11 * time.Minute, code: "REJECTED", corr: "c-park", tenant: "acme"},
		seed{id: "e1", dest: "billing", status: "EXHAUSTED", age: 20 * time.Minute, code: "PUBLISH_TIMEOUT"},
		seed{id: "done", dest: "orders", status: "PUBLISHED", age: 5 * time.Hour, corr: "c-old"},
	)
	_, err := s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, started_at, heartbeat_at, expires_at) VALUES
	    ('relay-live', $1, $1, $2), ('relay-dead', $1, $1, $3)`,
		t0.Add(-time.Hour), t0.Add(time.Minute), t0.Add(-time.Minute))
	require.NoError(t, err)
	return s
}

func TestCollectReadsEveryQuestionOperatorsAsk(t *testing.T) {
	t.Parallel()
	s := fixture(t)
	snap, err := CollectWith(context.Background(), s.DB, Options{Now: t0, StuckAfter: 30 * time.Minute})
	require.NoError(t, err)

	require.True(t, snap.At.Equal(t0))
	require.Equal(t, "POLLING", snap.Mode)
	require.EqualValues(t, 8, snap.Unpublished)
	require.EqualValues(t, 5, snap.Pending) // 3 PENDING + 1 IN_FLIGHT + 1 AMBIGUOUS
	require.EqualValues(t, 1, snap.Ambiguous)
	require.EqualValues(t, 2, snap.Failed)
	require.EqualValues(t, 1, snap.Exhausted)
	require.False(t, snap.Truncated)
	require.True(t, snap.OldestPendingAt.Equal(t0.Add(-3*time.Hour)), snap.OldestPendingAt)
	require.InDelta(t, (3 * time.Hour).Seconds(), snap.OldestPendingAgeSeconds, 0.001)

	require.Equal(t, []Count{{"PENDING", 3}, {"FAILED", 2}, {"AMBIGUOUS", 1}, {"EXHAUSTED", 1}, {"IN_FLIGHT", 1}}, snap.ByStatus)
	require.Equal(t, []Count{{"orders", 5}, {"billing", 3}}, snap.ByDestination)
	require.Equal(t, []Count{{"acme", 4}, {"", 3}, {"globex", 1}}, snap.ByTenant)
	require.Len(t, snap.Groups, 6)
	require.Equal(t, Group{Status: "AMBIGUOUS", Destination: "billing", Count: 1, Oldest: snap.Groups[0].Oldest}, snap.Groups[0])

	require.Equal(t, []FailureCode{
		{Status: "FAILED", Code: "REJECTED", Count: 2},
		{Status: "AMBIGUOUS", Code: "PUBLISH_TIMEOUT", Count: 1},
		{Status: "EXHAUSTED", Code: "PUBLISH_TIMEOUT", Count: 1},
	}, snap.FailureCodes)

	// c-amb: AMBIGUOUS for 3h (long pending); c-slow: PENDING for 1h; c-park:
	// two FAILED rows. c-fresh (1 minute) and c-old (PUBLISHED) are not stuck.
	require.Len(t, snap.StuckCorrelations, 3)
	require.Equal(t, "c-amb", snap.StuckCorrelations[0].CorrelationID)
	require.EqualValues(t, 0, snap.StuckCorrelations[0].Parked)
	require.EqualValues(t, 1, snap.StuckCorrelations[0].LongPending)
	require.Equal(t, "c-slow", snap.StuckCorrelations[1].CorrelationID)
	require.Equal(t, StuckCorrelation{CorrelationID: "c-park", Parked: 2, LongPending: 0, Oldest: snap.StuckCorrelations[2].Oldest}, snap.StuckCorrelations[2])
	require.True(t, snap.StuckCorrelations[2].Oldest.Equal(t0.Add(-11*time.Minute)))

	require.Len(t, snap.Relays, 1)
	require.Equal(t, "relay-live", snap.Relays[0].Owner)

	// The snapshot is the JSON contract of `outboxctl status --json`.
	raw, err := json.Marshal(snap)
	require.NoError(t, err)
	var back map[string]any
	require.NoError(t, json.Unmarshal(raw, &back))
	require.EqualValues(t, 2, back["failed"])
	require.Equal(t, "POLLING", back["relay_mode"])
}

func TestCollectBoundsAndThresholds(t *testing.T) {
	t.Parallel()
	s := fixture(t)
	ctx := context.Background()

	snap, err := CollectWith(ctx, s.DB, Options{Now: t0, MaxGroups: 2, MaxFailureCodes: 1, MaxStuck: 1, StuckAfter: 2 * time.Hour})
	require.NoError(t, err)
	require.True(t, snap.Truncated)
	require.Len(t, snap.Groups, 2)
	require.Len(t, snap.FailureCodes, 1)
	require.Equal(t, []StuckCorrelation{{CorrelationID: "c-amb", LongPending: 1, Oldest: snap.StuckCorrelations[0].Oldest}}, snap.StuckCorrelations)

	// With a 2h threshold, c-slow (1h) is no longer stuck; c-park still is (parked).
	snap, err = CollectWith(ctx, s.DB, Options{Now: t0, StuckAfter: 2 * time.Hour})
	require.NoError(t, err)
	var ids []string
	for _, c := range snap.StuckCorrelations {
		ids = append(ids, c.CorrelationID)
	}
	require.Equal(t, []string{"c-amb", "c-park"}, ids)

	// Mode switches show; an empty outbox reports zero ages, not garbage.
	_, err = s.DB.Exec(`UPDATE messaging_relay_mode SET mode = 'CDC', changed_by = 'test'`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`DELETE FROM messaging_outbox`)
	require.NoError(t, err)
	snap, err = Collect(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, "CDC", snap.Mode)
	require.Equal(t, "test", snap.ModeChangedBy)
	require.Zero(t, snap.Unpublished)
	require.Zero(t, snap.OldestPendingAgeSeconds)
	require.True(t, snap.OldestPendingAt.IsZero())
	// By the database clock (years before t0) both fixture heartbeats are
	// still in the future: the live-relay filter follows the clock it is given.
	require.Len(t, snap.Relays, 2)
}

func TestOptionsRefuseNegativeValues(t *testing.T) {
	t.Parallel()
	for _, o := range []Options{{StuckAfter: -time.Second}, {MaxGroups: -1}, {MaxFailureCodes: -1}, {MaxStuck: -1},
		{MaxGroups: math.MaxInt}, {MaxFailureCodes: MaxListed + 1}, {MaxStuck: math.MaxInt}} {
		_, err := CollectWith(context.Background(), nil, o)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%+v", o)
	}
}

func TestMessageReadsEveryColumn(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	ctx := context.Background()
	aggVersion := int64(4)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "m-1", Destination: "orders", Payload: []byte("{}"), Headers: map[string]string{"k": "v"},
		Status: envelope.StatusAmbiguous, Attempts: 3, LeaseOwner: "relay-a", LeaseToken: 7, LeaseExpiresAt: t0,
		LastFailureCode: "PUBLISH_TIMEOUT", LastFailureDetail: "no confirm within 5s", Tenant: "acme", PartitionKey: "order-9",
		CorrelationID: "corr-1", AggregateVersion: &aggVersion})

	row, err := Message(ctx, s.DB, "m-1")
	require.NoError(t, err)
	require.Equal(t, envelope.StatusAmbiguous, row.Status)
	require.Equal(t, map[string]string{"k": "v"}, row.Headers)
	require.Equal(t, []byte("{}"), row.Payload)
	require.Equal(t, 3, row.Attempts)
	require.Equal(t, "relay-a", row.LeaseOwner)
	require.EqualValues(t, 7, row.LeaseToken)
	require.True(t, row.LeaseExpiresAt.Equal(t0))
	require.Equal(t, "PUBLISH_TIMEOUT", row.LastFailureCode)
	require.Equal(t, "order-9", row.RoutingKey)
	require.EqualValues(t, 4, *row.AggregateVersion)

	_, err = Message(ctx, s.DB, "nope")
	require.ErrorIs(t, err, ErrMessageNotFound)
	_, err = Message(ctx, s.DB, "")
	require.ErrorIs(t, err, outbox.ErrMessageIDRequired)
}

// An id PostgreSQL text cannot hold (NUL, invalid UTF-8) names no row: it is
// STATUS_MESSAGE_NOT_FOUND, not the server's untyped 22021 refusal.
func TestMessageUnstorableIDIsNotFound(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	ctx := context.Background()
	for _, id := range []string{"\xff", "a\x00", "ok\xc3"} {
		_, err := Message(ctx, s.DB, id)
		require.ErrorIs(t, err, ErrMessageNotFound, "id %q: %v", id, err)
		require.Equal(t, CodeMessageNotFound, outbox.CodeOf(err), "id %q", id)
	}
}
