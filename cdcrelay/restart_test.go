package cdcrelay_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// currentWAL is the server's WAL insert position: at or past the end of every
// transaction committed before the call.
func (e *env) currentWAL(t *testing.T) pglogrepl.LSN {
	t.Helper()
	var s string
	require.NoError(t, e.s.DB.QueryRow(`SELECT pg_current_wal_insert_lsn()::text`).Scan(&s))
	lsn, err := pglogrepl.ParseLSN(s)
	require.NoError(t, err)
	return lsn
}

// TestPartialTransactionIsCompletedWithoutRepeats shows the package
// documentation's restart claim for a transaction of three messages of which
// the downstream accepted the first two before the third was refused, in each
// way the relay can stop or be cut off: the publish budget spent, Close, and
// the replication connection lost. The part the downstream accepted is
// marked PUBLISHED when the session ends, so the transaction is not
// confirmed, yet what is delivered next is the third message only: nothing
// twice.
func TestPartialTransactionIsCompletedWithoutRepeats(t *testing.T) {
	base := testdb.Logical(t)
	down := errors.New("downstream refused tx-3")

	cases := []struct {
		name string
		// attempts is cfg.MaxPublishAttempts of the first relay.
		attempts int
		// stop makes the first relay stop (or lose its connection) while
		// tx-3 is being published (its downstream refuses tx-3 every time)
		// and returns Run's error, or nil when the relay keeps running.
		// blocked receives once, with tx-3's first attempt held until
		// release is closed; the attempt then fails.
		stop      func(t *testing.T, e *env, r *cdcrelay.Relay, out *recorder, runErr <-chan error, blocked <-chan struct{}, release chan struct{}) error
		wantError func(t *testing.T, err error)
		// restart is false when the first relay is expected to carry on.
		restart bool
	}{
		{
			name:     "the publish budget is spent",
			attempts: 3,
			restart:  true,
			stop: func(t *testing.T, _ *env, _ *cdcrelay.Relay, _ *recorder, runErr <-chan error, _ <-chan struct{}, release chan struct{}) error {
				close(release)
				return receive(t, runErr)
			},
			wantError: func(t *testing.T, err error) {
				require.ErrorIs(t, err, cdcrelay.ErrPublishFailed)
				require.ErrorIs(t, err, down)
			},
		},
		{
			name:    "Close while tx-3 is being retried",
			restart: true,
			stop: func(t *testing.T, _ *env, r *cdcrelay.Relay, out *recorder, runErr <-chan error, _ <-chan struct{}, release chan struct{}) error {
				close(release)
				require.Eventually(t, func() bool { return out.attemptsOf("tx-3") >= 3 }, await.Patience(t), time.Millisecond)
				require.NoError(t, r.Close())
				return receive(t, runErr)
			},
			wantError: func(t *testing.T, err error) { require.NoError(t, err, "Close is a clean stop") },
		},
		{
			name: "the replication connection is lost while tx-3 is in the publisher",
			stop: func(t *testing.T, e *env, _ *cdcrelay.Relay, out *recorder, runErr <-chan error, blocked <-chan struct{}, release chan struct{}) error {
				select {
				case <-blocked:
				case <-time.After(await.Patience(t)):
					t.Fatal("tx-3 never reached the publisher")
				}
				// The server ends the walsender, as when the network
				// drops; the relay is still inside Publish.
				var terminated bool
				require.NoError(t, e.s.DB.QueryRow(`SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&terminated))
				require.True(t, terminated)
				close(release)
				// The refused attempt ends the session anyway; the relay
				// streams again from the confirmed position and retries.
				require.Eventually(t, func() bool { return out.attemptsOf("tx-3") >= 3 }, await.Patience(t), time.Millisecond)
				select {
				case err := <-runErr:
					t.Fatalf("Run returned: %v", err)
				default:
				}
				return nil
			},
			wantError: func(t *testing.T, err error) { require.NoError(t, err) },
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, base)
			e.enableCDC(t)
			cfg := e.config()
			cfg.MaxPublishAttempts = tc.attempts

			blocked, release := make(chan struct{}, 1), make(chan struct{})
			var refusing atomic.Bool
			refusing.Store(true)
			out := &recorder{refuse: func(_ string, m *message.Message) error {
				if m.UUID != "tx-3" || !refusing.Load() {
					return nil
				}
				select {
				case blocked <- struct{}{}:
				default:
				}
				<-release // holds the recorder's lock: the test reads it only after release
				return down
			}}
			r, err := cdcrelay.New(cfg, out, nil)
			require.NoError(t, err)
			runErr := make(chan error, 1)
			go func() { runErr <- r.Run(context.Background()) }()
			t.Cleanup(func() { _ = r.Close() })
			require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, await.Patience(t), 10*time.Millisecond)

			// A transaction delivered and confirmed before the partial one.
			e.publish(t, "orders", msg("before", "b", nil))
			beforeEnd := e.currentWAL(t)
			require.Eventually(t, func() bool { return e.confirmedLSN(t) >= beforeEnd }, await.Patience(t), 10*time.Millisecond)

			// One business transaction of three messages.
			e.publish(t, "orders",
				msg("tx-1", "one", map[string]string{"x-n": "1"}),
				msg("tx-2", "two", map[string]string{"x-n": "2"}),
				msg("tx-3", "three", map[string]string{"x-n": "3"}))
			txEnd := e.currentWAL(t)

			tc.wantError(t, tc.stop(t, e, r, out, runErr, blocked, release))
			require.Equal(t, []string{"before", "tx-1", "tx-2"}, out.ids(), "the first relay delivered part of the transaction")
			require.Less(t, e.confirmedLSN(t), txEnd, "the partial transaction was not confirmed")
			require.Eventually(t, func() bool { return e.s.Count(t, "message_id IN ('tx-1', 'tx-2') AND status = 'PUBLISHED'") == 2 }, await.Patience(t), 10*time.Millisecond,
				"what the downstream accepted is marked PUBLISHED")
			require.Equal(t, 1, e.s.Count(t, "message_id = 'tx-3' AND status = 'PENDING'"))

			refusing.Store(false)
			if tc.restart {
				require.Eventually(t, func() bool { return !e.slotActive(t) }, await.Patience(t), 10*time.Millisecond)
				r2, err := cdcrelay.New(e.config(), out, nil)
				require.NoError(t, err)
				wait2 := running(t, r2)
				t.Cleanup(func() { _ = wait2() })
			}
			require.Eventually(t, func() bool { return len(out.ids()) >= 4 }, await.Patience(t), 10*time.Millisecond)
			require.Eventually(t, func() bool { return e.confirmedLSN(t) >= txEnd }, await.Patience(t), 10*time.Millisecond,
				"once every message of it was accepted, the transaction is confirmed")
			// The rest of the transaction, once: the part accepted before is
			// not repeated.
			require.Equal(t, []string{"before", "tx-1", "tx-2", "tx-3"}, out.ids())
			out.mu.Lock()
			require.Equal(t, "three", string(out.got[3].Payload))
			require.Equal(t, "3", out.got[3].Metadata.Get("x-n"))
			out.mu.Unlock()
			require.Equal(t, 4, e.s.Count(t, "status = 'PUBLISHED'"))

			// And a later message is the only new delivery.
			e.publish(t, "orders", msg("after", "a", nil))
			require.Eventually(t, func() bool { return len(out.ids()) >= 5 }, await.Patience(t), 10*time.Millisecond)
			require.Equal(t, []string{"before", "tx-1", "tx-2", "tx-3", "after"}, out.ids())
		})
	}
}

func receive(t *testing.T, runErr <-chan error) error {
	t.Helper()
	select {
	case err := <-runErr:
		return err
	case <-time.After(await.Patience(t)):
		t.Fatal("Run did not return")
		return nil
	}
}
