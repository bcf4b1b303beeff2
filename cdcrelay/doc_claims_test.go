package cdcrelay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// TestRelayDocClaims shows the package documentation's claims about what the
// relay ignores and what it confirms against a real logical slot.
func TestRelayDocClaims(t *testing.T) {
	base := testdb.Logical(t)

	t.Run("a publication of every operation and of another schema's outbox yields this outbox's inserts only", func(t *testing.T) {
		e := newEnv(t, base)
		other := newEnv(t, base) // a second outbox in the same database
		e.enableCDC(t)
		cfg := e.config()
		cfg.CreatePublication = false
		// Wider than debezium.PublicationSQL on both axes: every operation,
		// and a second relation whose inserts are not this relay's.
		_, err := e.s.DB.Exec(`CREATE PUBLICATION ` + cfg.PublicationName + ` FOR TABLE ` +
			e.s.Name + `.messaging_outbox, ` + other.s.Name + `.messaging_outbox WITH (publish = 'insert, update, delete, truncate')`)
		require.NoError(t, err)
		out := &recorder{}
		wait := e.relay(t, cfg, out)

		e.publish(t, "orders", msg("ins-1", "1", nil), msg("ins-2", "2", nil))
		other.publish(t, "orders", msg("other-schema", "o", nil))
		e.publish(t, "orders", msg("ins-3", "3", nil))

		// UPDATEs: the relay's own marking of what it delivered PUBLISHED
		// (the same change the forwarder's fenced outcome makes).
		require.Eventually(t, func() bool { return e.s.Count(t, "status = 'PUBLISHED'") == 3 }, await.Patience(t), 10*time.Millisecond)
		// A DELETE, a plain UPDATE, a TRUNCATE, and the same on the other
		// schema's outbox.
		_, err = e.s.DB.Exec(`DELETE FROM messaging_outbox WHERE message_id = 'ins-1'`)
		require.NoError(t, err)
		_, err = e.s.DB.Exec(`UPDATE messaging_outbox SET destination = 'elsewhere' WHERE message_id = 'ins-2'`)
		require.NoError(t, err)
		_, err = e.s.DB.Exec(`TRUNCATE messaging_outbox`)
		require.NoError(t, err)
		_, err = other.s.DB.Exec(`UPDATE messaging_outbox SET destination = 'elsewhere'`)
		require.NoError(t, err)
		_, err = other.s.DB.Exec(`DELETE FROM messaging_outbox`)
		require.NoError(t, err)
		e.publish(t, "orders", msg("marker", "m", nil))

		// The marker commits last: once it is out, every change above was
		// streamed before it and ignored.
		require.Eventually(t, func() bool { return len(out.ids()) >= 4 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"ins-1", "ins-2", "ins-3", "marker"}, out.ids())
		for _, id := range out.ids() {
			require.Equal(t, 1, out.attemptsOf(id), id)
		}
		require.Zero(t, out.attemptsOf("other-schema"))
		require.NoError(t, wait())
	})

	t.Run("an idle relay confirms the server's keepalive position, so the slot does not hold WAL", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		cfg := e.config()
		cfg.StandbyTimeout = 250 * time.Millisecond
		out := &recorder{}
		wait := e.relay(t, cfg, out)

		// WAL that is not in the publication: a non-transactional logical
		// message has no transaction, so pgoutput sends no BEGIN/COMMIT the
		// relay could confirm; only the server's keepalive carries its
		// position. No outbox row is written in this test.
		_, err := e.s.DB.Exec(`SELECT pg_logical_emit_message(false, 'cdcrelay-test', 'idle')`)
		require.NoError(t, err)
		var lsnText string
		require.NoError(t, e.s.DB.QueryRow(`SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsnText))
		target, err := pglogrepl.ParseLSN(lsnText)
		require.NoError(t, err)
		require.Less(t, e.confirmedLSN(t), target, "the slot starts behind the new WAL")

		require.Eventually(t, func() bool { return e.confirmedLSN(t) >= target }, 8*cfg.StandbyTimeout, 10*time.Millisecond,
			"an idle slot's confirmed_flush_lsn reaches the server's WAL position")
		require.Empty(t, out.ids())
		require.NoError(t, wait())
	})

	// Issue 20 item 2: the old relay re-read the mode only every standby
	// timeout and not at all while it retried, so it published "held" after
	// the mode had left CDC.
	t.Run("the mode is checked before each publish: a mode changed behind the relay's back stops it before the next one", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		cfg := e.config()
		cfg.HeartbeatInterval, cfg.HeartbeatTTL = 50*time.Millisecond, 10*time.Second
		out := &recorder{refuse: func(_ string, m *message.Message) error {
			if m.UUID == "held" {
				return errors.New("downstream down")
			}
			return nil
		}}
		r, err := cdcrelay.New(cfg, out, nil) // MaxPublishAttempts 0: retry forever
		require.NoError(t, err)
		errc := make(chan error, 1)
		go func() { errc <- r.Run(context.Background()) }()
		t.Cleanup(func() { _ = r.Close() })
		require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, await.Patience(t), 10*time.Millisecond)

		e.publish(t, "orders", msg("held", "h", nil))
		e.publish(t, "orders", msg("next", "n", nil))
		require.Eventually(t, func() bool { return out.attemptsOf("held") > 0 }, await.Patience(t), 10*time.Millisecond)
		// Not Disable (it refuses while the relay's heartbeat is live): an
		// UPDATE that bypasses it, as a hand-made switch would.
		_, err = e.s.DB.Exec(`UPDATE messaging_relay_mode SET mode = 'POLLING' WHERE id`)
		require.NoError(t, err)
		select {
		case err = <-errc:
		case <-time.After(await.Patience(t)):
			t.Fatal("relay kept running after the mode left CDC")
		}
		require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
		require.Empty(t, out.ids(), "nothing was published once the mode had changed")
		require.Zero(t, out.attemptsOf("next"))
	})
}
