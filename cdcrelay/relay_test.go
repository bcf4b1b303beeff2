package cdcrelay_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a downstream that records what it accepted and can refuse.
type recorder struct {
	mu   sync.Mutex
	got  []*message.Message
	tops []string
	// refuse, when set, decides per attempt whether to fail it.
	refuse   func(topic string, m *message.Message) error
	attempts map[string]int
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.attempts == nil {
		r.attempts = map[string]int{}
	}
	for _, m := range msgs {
		r.attempts[m.UUID]++
		if r.refuse != nil {
			if err := r.refuse(topic, m); err != nil {
				return err
			}
		}
		r.got = append(r.got, m)
		r.tops = append(r.tops, topic)
	}
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) ids() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.got))
	for i, m := range r.got {
		out[i] = m.UUID
	}
	return out
}

func (r *recorder) attemptsOf(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.attempts[id]
}

// env is one isolated outbox on the logical-capable server.
type env struct {
	s    *testdb.Schema
	repl string // replication connection string
	slot string
}

func newEnv(t *testing.T, base string) *env {
	t.Helper()
	s := testdb.NewOn(t, base)
	e := &env{s: s, repl: testdb.ReplicationURL(base), slot: "slot_" + s.Name[len("outbox_test_"):]}
	// Registered before any relay of the test is started, so it runs after
	// their cleanups (Close) — also when the test failed half way.
	t.Cleanup(func() { dropSlots(t, s.DB, e.slot) })
	return e
}

// dropSlots removes every replication slot named prefix*, as a failed test
// leaves them too: a leaked slot counts against max_replication_slots and
// fails the next tests with 53400. A backend still holding one (a walsender
// whose relay is gone, or a slot creation that waits for a consistent point
// on a loaded machine) is terminated first; the loop follows the slots until
// they are gone, within the test's own deadline.
func dropSlots(t *testing.T, db *sql.DB, prefix string) {
	t.Helper()
	deadline := time.Now().Add(await.Patience(t))
	for {
		_, _ = db.Exec(`SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name LIKE $1 || '%' AND active`, prefix)
		_, _ = db.Exec(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE $1 || '%' AND NOT active`, prefix)
		var n int
		err := db.QueryRow(`SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE $1 || '%'`, prefix).Scan(&n)
		if err != nil || n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("replication slots %s* still exist: %d", prefix, n)
			return
		}
		time.Sleep(20 * time.Millisecond) // polling the backends' exit, which has no event to wait on
	}
}

func (e *env) config() cdcrelay.Config {
	return cdcrelay.Config{
		ConnString:        e.repl,
		DB:                e.s.DB,
		Schema:            e.s.Name,
		SlotName:          e.slot,
		PublicationName:   "pub_" + e.slot,
		CreateSlot:        true,
		CreatePublication: true,
		StandbyTimeout:    200 * time.Millisecond,
		SlotBusyWait:      time.Second,
		RetryInitial:      time.Millisecond,
		RetryMax:          5 * time.Millisecond,
	}
}

func (e *env) enableCDC(t *testing.T) {
	t.Helper()
	require.NoError(t, relaymode.Enable(context.Background(), e.s.DB, "test", time.Time{}))
}

func (e *env) confirmedLSN(t *testing.T) pglogrepl.LSN {
	t.Helper()
	var s sql.NullString
	require.NoError(t, e.s.DB.QueryRow(`SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&s))
	lsn, err := pglogrepl.ParseLSN(s.String)
	require.NoError(t, err)
	return lsn
}

func (e *env) slotActive(t *testing.T) bool {
	t.Helper()
	var active bool
	err := e.s.DB.QueryRow(`SELECT active FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&active)
	if errors.Is(err, sql.ErrNoRows) {
		return false
	}
	require.NoError(t, err)
	return active
}

// publish writes msgs in one business transaction through the real write path.
func (e *env) publish(t *testing.T, topic string, msgs ...*message.Message) {
	t.Helper()
	err := publisher.InTx(context.Background(), e.s.DB, publisher.Config{Producer: "orders"}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish(topic, msgs...)
	})
	require.NoError(t, err)
}

// running starts r.Run in the background; the returned func closes the relay
// and returns Run's error.
func running(t *testing.T, r *cdcrelay.Relay) (wait func() error) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		err := r.Run(context.Background())
		if err != nil {
			t.Logf("Run returned: %v", err)
		}
		errc <- err
	}()
	var once sync.Once
	var err error
	wait = func() error {
		once.Do(func() {
			require.NoError(t, r.Close())
			err = <-errc
		})
		return err
	}
	t.Cleanup(func() { _ = wait() })
	return wait
}

// relay starts a relay on cfg publishing to out and returns once its
// walsender streams (see streaming).
func (e *env) relay(t *testing.T, cfg cdcrelay.Config, out message.Publisher) (wait func() error) {
	t.Helper()
	r, err := cdcrelay.New(cfg, out, nil)
	require.NoError(t, err)
	return e.streaming(t, r)
}

// streaming starts r and waits until it streams from the slot: a slot only
// holds what commits after it was created.
func (e *env) streaming(t *testing.T, r *cdcrelay.Relay) (wait func() error) {
	t.Helper()
	wait = running(t, r)
	require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, await.Patience(t), 10*time.Millisecond)
	return wait
}

// walsenderStreaming reports whether a walsender holds the slot. Not just
// "active": pg_create_logical_replication_slot holds the slot in an ordinary
// backend while it looks for its consistent point, before confirmed_flush_lsn
// is set and before the slot holds anything.
func (e *env) walsenderStreaming(t *testing.T) bool {
	t.Helper()
	var ok bool
	// The relay creates its slot over a replication connection too: that
	// walsender holds the slot before it has a confirmed position; only the
	// streaming session has one.
	require.NoError(t, e.s.DB.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
		WHERE s.slot_name = $1 AND s.confirmed_flush_lsn IS NOT NULL AND r.state IN ('streaming', 'catchup'))`, e.slot).Scan(&ok))
	return ok
}

func msg(id, payload string, md map[string]string) *message.Message {
	m := message.NewMessage(id, []byte(payload))
	for k, v := range md {
		m.Metadata.Set(k, v)
	}
	return m
}

func TestRelay(t *testing.T) {
	base := testdb.Logical(t)

	t.Run("committed inserts are published in commit order with id, payload and metadata", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		out := &recorder{}
		wait := e.relay(t, e.config(), out)

		payload := "\x00\x01binary\xff\\x"
		e.publish(t, "orders", msg("id-1", payload, map[string]string{
			"x-app": "a \"quoted\" \\ value", envelope.KeyCorrelationID: "corr-1", envelope.KeyTenant: "acme",
			envelope.KeyPartitionKey: "order-9", envelope.KeyAggregateVersion: "7", envelope.KeyOccurredAt: "2024-02-03T04:05:06.123456Z",
		}), msg("id-2", "second", nil))
		e.publish(t, "payments", msg("id-3", "third", nil))

		require.Eventually(t, func() bool { return len(out.ids()) == 3 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"id-1", "id-2", "id-3"}, out.ids())
		out.mu.Lock()
		first, tops := out.got[0], append([]string(nil), out.tops...)
		out.mu.Unlock()
		require.Equal(t, []string{"orders", "orders", "payments"}, tops)
		require.Equal(t, []byte(payload), []byte(first.Payload))
		require.Equal(t, "a \"quoted\" \\ value", first.Metadata.Get("x-app"))
		require.Equal(t, "corr-1", first.Metadata.Get("msg.correlation_id"))
		require.Equal(t, "corr-1", first.Metadata.Get("correlation_id"))
		require.Equal(t, "acme", first.Metadata.Get("msg.tenant"))
		require.Equal(t, "order-9", first.Metadata.Get("msg.partition_key"))
		require.Equal(t, "7", first.Metadata.Get("msg.aggregate_version"))
		require.Equal(t, "orders", first.Metadata.Get("msg.producer"))
		require.Equal(t, "2024-02-03T04:05:06.123456Z", first.Metadata.Get("msg.occurred_at"))

		// The same message the polling relay would build from the row.
		row, err := envelope.ScanRow(e.s.DB.QueryRow(`SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox WHERE message_id = 'id-1'`))
		require.NoError(t, err)
		want, err := envelope.ToMessage(row, envelope.Options{})
		require.NoError(t, err)
		require.Equal(t, want.Metadata, first.Metadata)

		require.NoError(t, wait())
	})

	// cdcrelay/doc.go: commit order, not insert order (where the CDC relay
	// differs from the polling forwarder's seq order).
	t.Run("transactions arrive in commit order even when they inserted in the other order", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		out := &recorder{}
		e.relay(t, e.config(), out)

		ctx := context.Background()
		first, err := e.s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = first.Rollback() }()
		pub, err := publisher.New(first, publisher.Config{}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders", msg("inserted-first", "x", nil)))
		e.publish(t, "orders", msg("committed-first", "y", nil)) // its own transaction, inserted and committed now
		require.NoError(t, first.Commit())

		require.Eventually(t, func() bool { return len(out.ids()) == 2 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"committed-first", "inserted-first"}, out.ids())
		var firstSeq, secondSeq int64
		require.NoError(t, e.s.DB.QueryRow(`SELECT (SELECT seq FROM messaging_outbox WHERE message_id = 'inserted-first'),
		       (SELECT seq FROM messaging_outbox WHERE message_id = 'committed-first')`).Scan(&firstSeq, &secondSeq))
		require.Less(t, firstSeq, secondSeq, "seq order is the other way round")
	})

	t.Run("rolled-back inserts are never published", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		out := &recorder{}
		e.relay(t, e.config(), out)

		rollback := errors.New("business rule failed")
		err := publisher.InTx(context.Background(), e.s.DB, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
			require.NoError(t, pub.Publish("orders", msg("rolled-back", "x", nil)))
			return rollback
		})
		require.ErrorIs(t, err, rollback)
		e.publish(t, "orders", msg("after", "y", nil))

		// The later committed message arriving proves the stream passed the
		// rolled-back transaction's position.
		require.Eventually(t, func() bool { return len(out.ids()) == 1 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"after"}, out.ids())
		require.Zero(t, out.attemptsOf("rolled-back"))
	})

	t.Run("forwarder updates and retention deletes are not published", func(t *testing.T) {
		e := newEnv(t, base)
		out := &recorder{}
		r, err := cdcrelay.New(e.config(), out, nil)
		require.NoError(t, err)
		// The documented switch: prepare the slot while polling runs.
		require.NoError(t, r.Prepare(context.Background()))

		e.publish(t, "orders", msg("polled-1", "a", nil), msg("polled-2", "b", nil))
		sink := &recorder{}
		fw, err := forwarder.New(e.s.DB, sink, nil, forwarder.Config{Owner: "fw-test"})
		require.NoError(t, err)
		rep, err := fw.RunOnce(context.Background())
		require.NoError(t, err)
		require.Equal(t, 2, rep.Published, "the forwarder UPDATEd both rows to PUBLISHED")
		require.NoError(t, fw.Close())
		require.Equal(t, 2, e.s.Count(t, "status = 'PUBLISHED'"))

		e.enableCDC(t)
		cl, err := retention.New(e.s.DB, nil, retention.Config{Mode: retention.ByCreatedAt, Horizon: time.Hour, AllowShortHorizons: true, Now: func() time.Time { return time.Now().Add(2 * time.Hour) }})
		require.NoError(t, err)
		res, err := cl.Run(context.Background())
		require.NoError(t, err)
		require.Equal(t, 2, res.Deleted, "retention DELETEd both rows")
		e.publish(t, "orders", msg("marker", "m", nil))

		wait := running(t, r)
		require.Eventually(t, func() bool { return len(out.ids()) == 3 }, await.Patience(t), 10*time.Millisecond)
		// Each insert once: the forwarder had published the first two, but
		// retention deleted them before they were streamed, so the relay
		// cannot tell and publishes them (a row the relay finds PUBLISHED is
		// skipped: TestHandoverRoundTrip); the marker is last, so every
		// UPDATE and DELETE before it was seen and ignored.
		require.Equal(t, []string{"polled-1", "polled-2", "marker"}, out.ids())
		require.NoError(t, wait())
	})

	t.Run("a refused message is retried with the same id and its position is not confirmed", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		down := errors.New("broker down")
		out := &recorder{refuse: func(_ string, m *message.Message) error {
			if m.UUID == "poison" {
				return down
			}
			return nil
		}}
		cfg := e.config()
		cfg.MaxPublishAttempts = 3
		r, err := cdcrelay.New(cfg, out, nil)
		require.NoError(t, err)
		errc := make(chan error, 1)
		go func() { errc <- r.Run(context.Background()) }()
		t.Cleanup(func() { _ = r.Close() })
		// Streaming, not only active: Run creates the slot, and the backend
		// that creates it holds it while it waits for a consistent point
		// (for the transactions of other tests on a loaded machine); a row
		// committed meanwhile is older than the slot and never streamed.
		require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, await.Patience(t), 10*time.Millisecond)

		e.publish(t, "orders", msg("ok-1", "1", nil))
		require.Eventually(t, func() bool { return len(out.ids()) == 1 }, await.Patience(t), 10*time.Millisecond)
		before := e.confirmedLSN(t)

		e.publish(t, "orders", msg("poison", "p", map[string]string{"x-k": "v"}))
		// At least the end of poison's commit record.
		var insertLSN string
		require.NoError(t, e.s.DB.QueryRow(`SELECT pg_current_wal_insert_lsn()::text`).Scan(&insertLSN))
		poisonEnd, err := pglogrepl.ParseLSN(insertLSN)
		require.NoError(t, err)

		select {
		case err = <-errc: // Run stops by itself once the attempts are spent
		case <-time.After(await.Patience(t)):
			t.Fatal("Run did not give up after MaxPublishAttempts")
		}
		require.ErrorIs(t, err, cdcrelay.ErrPublishFailed)
		require.ErrorIs(t, err, down)
		require.Equal(t, outbox.Code("CDC_PUBLISH_FAILED"), outbox.CodeOf(err))
		require.Equal(t, 3, out.attemptsOf("poison"))
		require.Equal(t, []string{"ok-1"}, out.ids())

		after := e.confirmedLSN(t)
		require.GreaterOrEqual(t, after, before)
		require.Less(t, after, poisonEnd, "the slot did not move past the refused message")
		require.Eventually(t, func() bool { return !e.slotActive(t) }, await.Patience(t), 10*time.Millisecond)
		var pending int
		require.NoError(t, e.s.DB.QueryRow(`SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', 'publication_names', $2)`, e.slot, cfg.PublicationName).Scan(&pending))
		require.Positive(t, pending, "the slot still holds the refused transaction")

		// The downstream recovers; a new relay delivers it again, same id.
		out.mu.Lock()
		out.refuse = nil
		out.mu.Unlock()
		r2, err := cdcrelay.New(cfg, out, nil)
		require.NoError(t, err)
		wait2 := running(t, r2)
		require.Eventually(t, func() bool { return len(out.ids()) == 2 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"ok-1", "poison"}, out.ids())
		out.mu.Lock()
		require.Equal(t, "v", out.got[1].Metadata.Get("x-k"))
		out.mu.Unlock()
		require.Eventually(t, func() bool { return e.confirmedLSN(t) >= poisonEnd }, await.Patience(t), 10*time.Millisecond)
		require.NoError(t, wait2())
	})

	t.Run("a downstream that fails a few times within the budget delivers once more and moves on", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		out := &recorder{}
		var failed int
		out.refuse = func(_ string, m *message.Message) error {
			if m.UUID == "flaky" && failed < 4 {
				failed++
				return fmt.Errorf("attempt %d refused", failed)
			}
			return nil
		}
		r, err := cdcrelay.New(e.config(), out, nil) // MaxPublishAttempts 0: retry forever
		require.NoError(t, err)
		wait := e.streaming(t, r)
		e.publish(t, "orders", msg("flaky", "f", nil), msg("next", "n", nil))
		require.Eventually(t, func() bool { return len(out.ids()) == 2 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"flaky", "next"}, out.ids())
		require.Equal(t, 5, out.attemptsOf("flaky"))
		require.NoError(t, wait())
	})

	// Issue 20 item 2: on the old code Disable succeeded under a streaming
	// relay and both relays published the rows written meanwhile.
	t.Run("refuses while the relay mode is POLLING; while it streams Disable refuses; after it stops Disable succeeds", func(t *testing.T) {
		e := newEnv(t, base)
		r, err := cdcrelay.New(e.config(), &recorder{}, nil)
		require.NoError(t, err)
		err = r.Run(context.Background())
		require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
		require.Equal(t, outbox.Code("RELAY_MODE_CONFLICT"), outbox.CodeOf(err))

		e.enableCDC(t)
		wait := e.streaming(t, r)
		// Its heartbeat is live once it has beaten since it began to stream:
		// creating the slot waits for every running transaction on the
		// server, and a heartbeat may expire meanwhile.
		var live []relaymode.Heartbeat
		require.Eventually(t, func() bool {
			live, err = relaymode.LiveCDCConsumers(context.Background(), e.s.DB, time.Time{})
			return err == nil && len(live) == 1
		}, await.Patience(t), 10*time.Millisecond, "the relay registered its CDC heartbeat")
		require.Equal(t, e.slot, live[0].SlotName)
		err = relaymode.Disable(context.Background(), e.s.DB, "test")
		require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
		require.Contains(t, err.Error(), live[0].Owner)
		err = relaymode.Beat(context.Background(), e.s.DB, "fw", time.Minute)
		require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "no forwarder while the CDC relay is live")

		require.NoError(t, wait())
		live, err = relaymode.LiveCDCConsumers(context.Background(), e.s.DB, time.Time{})
		require.NoError(t, err)
		require.Empty(t, live, "a stopped relay removes its heartbeat")
		require.NoError(t, relaymode.Disable(context.Background(), e.s.DB, "test"))
	})

	// Issue 20 item 2: a second CDC relay on another slot was streaming side
	// by side with the first, each delivering every row.
	t.Run("a second CDC relay on another slot is refused", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		first := &recorder{}
		wait := e.relay(t, e.config(), first)
		cfg := e.config()
		cfg.SlotName, cfg.Owner = e.slot+"_b", "second"
		t.Cleanup(func() {
			_, _ = e.s.DB.Exec(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, cfg.SlotName)
		})
		second := &recorder{}
		r2, err := cdcrelay.New(cfg, second, nil)
		require.NoError(t, err)
		err = r2.Run(context.Background())
		require.ErrorIs(t, err, relaymode.ErrSecondCDCConsumer)
		require.Equal(t, outbox.Code("CDC_SECOND_CONSUMER"), outbox.CodeOf(err))
		e.publish(t, "orders", msg("once", "o", nil))
		require.Eventually(t, func() bool { return len(first.ids()) == 1 }, await.Patience(t), 10*time.Millisecond)
		require.Empty(t, second.ids())
		require.NoError(t, wait())
	})

	t.Run("one relay per slot, missing slot and publication, closed relay", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		cfg := e.config()
		cfg.CreateSlot, cfg.CreatePublication = false, false

		r, err := cdcrelay.New(cfg, &recorder{}, nil)
		require.NoError(t, err)
		require.ErrorIs(t, r.Run(context.Background()), cdcrelay.ErrPublicationMissing)

		_, err = e.s.DB.Exec(`CREATE PUBLICATION ` + cfg.PublicationName + ` FOR TABLE messaging_outbox WITH (publish = 'update')`)
		require.NoError(t, err)
		err = r.Run(context.Background())
		require.ErrorIs(t, err, cdcrelay.ErrPublicationMissing, "a publication without inserts is refused")
		_, err = e.s.DB.Exec(`ALTER PUBLICATION ` + cfg.PublicationName + ` SET (publish = 'insert')`)
		require.NoError(t, err)

		require.ErrorIs(t, r.Run(context.Background()), cdcrelay.ErrSlotMissing)

		require.NoError(t, r.Prepare(context.Background()))
		first := running(t, r)
		require.Eventually(t, func() bool { return e.slotActive(t) }, await.Patience(t), 10*time.Millisecond)
		other, err := cdcrelay.New(cfg, &recorder{}, nil)
		require.NoError(t, err)
		err = other.Run(context.Background())
		require.ErrorIs(t, err, cdcrelay.ErrSlotInUse)
		require.Equal(t, outbox.Code("CDC_SLOT_IN_USE"), outbox.CodeOf(err))
		require.ErrorIs(t, r.Run(context.Background()), cdcrelay.ErrAlreadyRunning)
		require.NoError(t, first())

		require.ErrorIs(t, r.Run(context.Background()), cdcrelay.ErrRelayClosed)
		require.NoError(t, r.Close(), "Close twice is fine")
	})

	t.Run("a schema mismatch between Config.Schema and DB is refused", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		cfg := e.config()
		cfg.Schema = "public"
		r, err := cdcrelay.New(cfg, &recorder{}, nil)
		require.NoError(t, err)
		require.ErrorIs(t, r.Run(context.Background()), outbox.ErrInvalidConfig)
	})

	t.Run("a row that cannot become a message stops the relay, or is skipped when configured", func(t *testing.T) {
		e := newEnv(t, base)
		e.enableCDC(t)
		// Raw SQL that bypassed the publisher: a reserved header name.
		insert := `INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ($1, 'orders', '\x01', $2::jsonb)`
		out := &recorder{}
		cfg := e.config()
		r, err := cdcrelay.New(cfg, out, nil)
		require.NoError(t, err)
		require.NoError(t, r.Prepare(context.Background()))
		_, err = e.s.DB.Exec(insert, "bad-2", `{"msg.bogus": "x"}`)
		require.NoError(t, err)
		_, err = e.s.DB.Exec(insert, "good", `{}`)
		require.NoError(t, err)
		err = r.Run(context.Background())
		require.ErrorIs(t, err, outbox.ErrReservedHeader)
		require.Empty(t, out.ids())

		cfg.SkipUndecodable = true
		r2, err := cdcrelay.New(cfg, out, nil)
		require.NoError(t, err)
		wait := running(t, r2)
		require.Eventually(t, func() bool { return len(out.ids()) == 1 }, await.Patience(t), 10*time.Millisecond)
		require.Equal(t, []string{"good"}, out.ids())
		require.NoError(t, wait())
	})
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
	require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, await.Patience(t), 10*time.Millisecond)
	e.publish(t, "orders", msg("held", "h", nil))
	require.Eventually(t, func() bool { return out.attemptsOf("held") >= 3 }, await.Patience(t), 10*time.Millisecond, "the relay is retrying")

	start := time.Now()
	require.NoError(t, c.Stop("fast", 30*time.Second), "a fast shutdown during the outage")
	t.Logf("fast shutdown took %s", time.Since(start))
	select {
	case err := <-runErr:
		require.Error(t, err, "the server is gone")
		require.Empty(t, outbox.CodeOf(err), "a connection failure, not a refusal: %v", err)
	case <-time.After(await.Patience(t)):
		t.Fatal("Run did not return after the server stopped")
	}

	// Server and downstream back: the message is delivered once.
	require.NoError(t, c.Start())
	down.Store(false)
	r2, err := cdcrelay.New(cfg, out, nil)
	require.NoError(t, err)
	wait := running(t, r2)
	require.Eventually(t, func() bool { return len(out.ids()) == 1 }, await.Patience(t), 10*time.Millisecond)
	require.Equal(t, []string{"held"}, out.ids())
	require.NoError(t, wait())
}
