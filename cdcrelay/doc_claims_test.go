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
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testdb"
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

		// UPDATEs: the forwarder's fenced claim and PUBLISHED outcome.
		claimed, err := fencing.Claim(context.Background(), e.s.DB, fencing.ClaimParams{
			Owner: "fw", Limit: 10, Lease: time.Minute, MaxAttempts: 5, Policy: fencing.BlockKey,
		})
		require.NoError(t, err)
		require.Len(t, claimed, 3)
		outcomes := make([]fencing.Outcome, len(claimed))
		for i, c := range claimed {
			outcomes[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished}
		}
		res, err := fencing.Apply(context.Background(), e.s.DB, outcomes)
		require.NoError(t, err)
		require.Equal(t, []fencing.Result{fencing.Applied, fencing.Applied, fencing.Applied}, res)
		require.Equal(t, 3, e.s.Count(t, "status = 'PUBLISHED'"))
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
		require.Eventually(t, func() bool { return len(out.ids()) >= 4 }, 20*time.Second, 10*time.Millisecond)
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

	t.Run("the mode is not re-read while a refused publish is retried; the stop comes after it succeeds", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		cfg := e.config()
		cfg.StandbyTimeout = 100 * time.Millisecond
		var (
			release     bool
			lastRefusal time.Time
		)
		out := &recorder{refuse: func(_ string, m *message.Message) error {
			if m.UUID == "held" && !release {
				lastRefusal = time.Now()
				return errors.New("downstream down")
			}
			return nil
		}}
		r, err := cdcrelay.New(cfg, out, nil) // MaxPublishAttempts 0: retry forever
		require.NoError(t, err)
		errc := make(chan error, 1)
		go func() { errc <- r.Run(context.Background()) }()
		t.Cleanup(func() { _ = r.Close() })
		require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, 20*time.Second, 10*time.Millisecond)

		e.publish(t, "orders", msg("held", "h", nil))
		e.publish(t, "orders", msg("next", "n", nil))
		require.Eventually(t, func() bool { return out.attemptsOf("held") > 0 }, 20*time.Second, 10*time.Millisecond)
		require.NoError(t, debezium.Disable(context.Background(), e.s.DB, "test"))
		disabled := time.Now()

		// Still retrying three StandbyTimeouts after the switch to POLLING.
		require.Eventually(t, func() bool {
			out.mu.Lock()
			defer out.mu.Unlock()
			return lastRefusal.After(disabled.Add(3 * cfg.StandbyTimeout))
		}, 20*time.Second, 10*time.Millisecond)
		select {
		case err := <-errc:
			t.Fatalf("Run returned while a publish was being retried: %v", err)
		default:
		}

		out.mu.Lock()
		release = true
		out.mu.Unlock()
		select {
		case err = <-errc:
		case <-time.After(20 * time.Second):
			t.Fatal("relay kept streaming after the publish succeeded in POLLING mode")
		}
		require.ErrorIs(t, err, debezium.ErrRelayModeConflict)
		require.Equal(t, []string{"held"}, out.ids(), "the mode was re-read before the next message")
		require.Zero(t, out.attemptsOf("next"))
	})
}
