package debezium_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func TestPublicationSQLCreatesAnInsertOnlyPublication(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	pub := "h4_pub_" + strings.TrimPrefix(s.Name, "outbox_test_")
	stmt, err := debezium.PublicationSQL(debezium.Options{Schema: s.Name, PublicationName: pub})
	require.NoError(t, err)
	require.Equal(t, `CREATE PUBLICATION "`+pub+`" FOR TABLE "`+s.Name+`"."messaging_outbox", "`+s.Name+`"."messaging_cdc_heartbeat" WITH (publish = 'insert')`, stmt)
	_, err = s.DB.Exec(stmt)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = s.DB.Exec(`DROP PUBLICATION IF EXISTS "` + pub + `"`) })

	var ins, upd, del, trunc bool
	require.NoError(t, s.DB.QueryRow(`SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = $1`, pub).Scan(&ins, &upd, &del, &trunc))
	require.True(t, ins, "inserts are published")
	require.False(t, upd, "the forwarder's updates must not become events")
	require.False(t, del, "retention's deletes must not become events")
	require.False(t, trunc)
	var tables string
	require.NoError(t, s.DB.QueryRow(`SELECT string_agg(schemaname || '.' || tablename, ',' ORDER BY tablename) FROM pg_publication_tables WHERE pubname = $1`, pub).Scan(&tables))
	require.Equal(t, s.Name+".messaging_cdc_heartbeat,"+s.Name+".messaging_outbox", tables, "the outbox and the heartbeat table")
}

// The heartbeat action query, run as the connector runs it (one statement on
// a plain connection), registers a live CDC consumer that Disable sees,
// inserts a heartbeat row (published: the table is in the publication) and
// trims old rows.
func TestHeartbeatActionQueryRegistersTheConnector(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	ctx := context.Background()
	q, err := debezium.HeartbeatActionQuery(debezium.Options{Schema: s.Name, Name: "orders-cdc", HeartbeatIntervalMS: 20000})
	require.NoError(t, err)
	require.Equal(t, debezium.Generate(debezium.Options{Schema: s.Name, Name: "orders-cdc", HeartbeatIntervalMS: 20000}).Settings["heartbeat.action.query"], q)

	require.NoError(t, relaymode.Enable(ctx, s.DB, "ops", time.Time{}))
	_, err = s.DB.Exec(`INSERT INTO messaging_cdc_heartbeat (slot_name, beat_at) VALUES ('old', now() - interval '2 hours')`)
	require.NoError(t, err)
	_, err = s.DB.Exec(q)
	require.NoError(t, err)
	_, err = s.DB.Exec(q) // the second beat renews the first
	require.NoError(t, err)

	live, err := relaymode.LiveCDCConsumers(ctx, s.DB, time.Time{})
	require.NoError(t, err)
	require.Len(t, live, 1)
	require.Equal(t, "debezium:orders-cdc", live[0].Owner)
	require.Equal(t, relaymode.ModeCDC, live[0].Kind)
	require.Equal(t, "messaging_outbox_cdc", live[0].SlotName)
	require.WithinDuration(t, live[0].HeartbeatAt.Add(60*time.Second), live[0].ExpiresAt, time.Second, "three intervals")
	polling, err := relaymode.LiveRelays(ctx, s.DB, time.Time{})
	require.NoError(t, err)
	require.Empty(t, polling, "a CDC heartbeat is not a polling relay")

	var slots []string
	rows, err := s.DB.Query(`SELECT slot_name FROM messaging_cdc_heartbeat ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		slots = append(slots, n)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"messaging_outbox_cdc", "messaging_outbox_cdc"}, slots, "one row per beat; the two-hour-old row was trimmed")

	err = relaymode.Disable(ctx, s.DB, "ops")
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "the connector is live")
	require.Contains(t, err.Error(), "debezium:orders-cdc")
	require.NoError(t, relaymode.DisableAt(ctx, s.DB, "ops", time.Now().Add(2*time.Minute)), "once its heartbeat expired (connector stopped)")
}
