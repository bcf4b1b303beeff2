package main

import (
	"context"
	"database/sql"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wmforwarder "github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Prefill statements: the backlog is generated on the server, in chunks of
// prefillChunk rows per transaction (several transactions, as a real backlog
// has; watermill-sql orders by transaction id).
const (
	prefillChunk = 5000

	prefillOutbox = `INSERT INTO messaging_outbox (message_id, destination, payload)
SELECT $1::text || g, $2::text, $3::bytea FROM generate_series($4::int, $5::int) g`

	// prefillWatermill writes what components/forwarder's publisher writes:
	// a JSON envelope (destination, uuid, base64 payload, metadata) in a
	// watermill-sql row stamped with the writing transaction's id.
	prefillWatermill = `INSERT INTO "watermill_forwarder_topic" (uuid, payload, metadata, transaction_id)
SELECT gen_random_uuid()::text,
       json_build_object('destination_topic', $1::text, 'uuid', $2::text || g,
                         'payload', translate(encode($3::bytea, 'base64'), E'\n', ''), 'metadata', '{}'::json),
       '{}'::json, pg_current_xact_id()
  FROM generate_series($4::int, $5::int) g`

	// prefillPublished is a backlog retention may delete: PUBLISHED rows
	// whose published_at is far past the default 72h horizon.
	prefillPublished = `INSERT INTO messaging_outbox (message_id, destination, payload, status, published_at, attempts)
SELECT $1::text || g, $2::text, $3::bytea, 'PUBLISHED', now() - interval '30 days', 1
  FROM generate_series($4::int, $5::int) g`
)

// The minimal relay: claim with SKIP LOCKED, publish, one UPDATE for the
// whole batch, all in one transaction. It records per-row state (status,
// published_at) and nothing else: no lease, no token, no attempt count.
const (
	minimalClaim = `SELECT message_id, destination, payload FROM messaging_outbox
 WHERE published_at IS NULL AND parked_at IS NULL AND status = 'PENDING'
 ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED`
	minimalDone = `UPDATE messaging_outbox SET status = 'PUBLISHED', published_at = now()
 WHERE message_id = ANY($1::text[])`
)

// Relay kinds of the drain scenarios.
const (
	relayOurs          = "outbox"                  // this module's forwarder (fencing on), defaults
	relayOursTuned     = "outbox-tuned"            // same, BatchSize ourTunedBatch (watermill tuned reads 1000 per query)
	relayOursNoPF      = "outbox-noprefetch"       // defaults but DisablePrefetch: the pipelining's paired baseline
	relayOursB100      = "outbox-b100"             // BatchSize 100, fixed: the minimal relay's batch, claim for claim
	relayOursTunedNoPF = "outbox-tuned-noprefetch" // BatchSize ourTunedBatch, DisablePrefetch
	relayOursLanes     = "outbox-lanes"            // defaults with Fence: FenceLanes (one write per message)
	ourTunedBatch      = 1000
	relayWMDefault     = "watermill"        // components/forwarder + watermill-sql subscriber, defaults
	relayWMTuned       = "watermill-tuned"  // same, PollInterval 10ms, batch 1000
	relayMinimal       = "skiplocked"       // minimal SKIP LOCKED relay, one UPDATE per batch
	relayMinimalTuned  = "skiplocked-tuned" // same, batch minimalTunedBatch
	wmTunedPoll        = 10 * time.Millisecond
	wmTunedBatch       = 1000
	minimalBatchSize   = forwarder.DefaultBatchSize
	minimalTunedBatch  = ourTunedBatch
)

func prefill(ctx context.Context, db *sql.DB, query, prefix string, n int, payload []byte) error {
	for lo := 1; lo <= n; lo += prefillChunk {
		hi := min(lo+prefillChunk-1, n)
		var err error
		if query == prefillWatermill {
			_, err = db.ExecContext(ctx, query, benchTopic, prefix, payload, lo, hi)
		} else {
			_, err = db.ExecContext(ctx, query, prefix, benchTopic, payload, lo, hi)
		}
		if err != nil {
			return fmt.Errorf("prefill: %w", err)
		}
	}
	_, err := db.ExecContext(ctx, "ANALYZE")
	return err
}

// sink is the downstream: a watermill GoChannel with one subscriber that
// acks and counts.
type sink struct {
	ch     *gochannel.GoChannel
	count  atomic.Int64
	target int64
	done   chan struct{}
	once   sync.Once
	// onMessage, when set, sees every message as it arrives.
	onMessage func(*message.Message, time.Time)
}

func newSink(ctx context.Context, target int) (*sink, error) {
	s := &sink{
		ch:     gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, watermill.NopLogger{}),
		target: int64(target),
		done:   make(chan struct{}),
	}
	msgs, err := s.ch.Subscribe(ctx, benchTopic)
	if err != nil {
		return nil, err
	}
	go func() {
		for m := range msgs {
			if s.onMessage != nil {
				s.onMessage(m, time.Now())
			}
			m.Ack()
			if s.count.Add(1) == s.target {
				s.once.Do(func() { close(s.done) })
			}
		}
	}()
	return s, nil
}

func (s *sink) close() { _ = s.ch.Close() }

// relay is a running relay of any kind; stop drains it and waits (once;
// later calls return at once).
type relay struct {
	stop func()
}

// startRelay starts n relays of kind on the schema, publishing to out.
// listen turns LISTEN/NOTIFY wake-up on for this module's forwarder.
func startRelay(ctx context.Context, s *schema, kind string, n int, out message.Publisher, listen bool) (*relay, error) {
	var stops []func()
	stopAll := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	for range n {
		db, err := s.open(3)
		if err != nil {
			stopAll()
			return nil, err
		}
		stops = append(stops, func() { _ = db.Close() })
		rctx, cancel := context.WithCancel(ctx)
		errc := make(chan error, 1)
		switch kind {
		case relayOurs, relayOursTuned, relayOursNoPF, relayOursTunedNoPF, relayOursB100, relayOursLanes, relayWMDefault, relayWMTuned:
			f, err := newForwarder(kind, s, db, out, listen)
			if err != nil {
				cancel()
				stopAll()
				return nil, err
			}
			go func() { errc <- f.Run(rctx) }()
			select {
			case <-f.Running():
			case err := <-errc:
				cancel()
				stopAll()
				return nil, fmt.Errorf("%s relay did not start: %w", kind, err)
			}
			stops = append(stops, func() { _ = f.Close(); cancel(); <-errc })
		case relayOneCommit:
			go func() { errc <- runOneCommit(rctx, db, out) }()
			stops = append(stops, func() { cancel(); <-errc })
		case relayMinimal, relayMinimalTuned:
			batch := minimalBatchSize
			if kind == relayMinimalTuned {
				batch = minimalTunedBatch
			}
			go func() { errc <- runMinimal(rctx, db, out, batch) }()
			stops = append(stops, func() { cancel(); <-errc })
		default:
			cancel()
			stopAll()
			return nil, fmt.Errorf("unknown relay %q", kind)
		}
	}
	return &relay{stop: sync.OnceFunc(stopAll)}, nil
}

// runner is what this module's forwarder and watermill's share: Run until
// Close, Running closed once started.
type runner interface {
	Run(ctx context.Context) error
	Running() chan struct{}
	Close() error
}

// newForwarder builds the forwarder of kind (ours or watermill's) on db.
// listen turns LISTEN/NOTIFY wake-up on for ours.
func newForwarder(kind string, s *schema, db *sql.DB, out message.Publisher, listen bool) (runner, error) {
	switch kind {
	case relayWMDefault, relayWMTuned:
		cfg := wsql.SubscriberConfig{
			SchemaAdapter:  wsql.DefaultPostgreSQLSchema{},
			OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		}
		if kind == relayWMTuned {
			cfg.SchemaAdapter = wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: wmTunedBatch}
			cfg.PollInterval = wmTunedPoll
		}
		sub, err := wsql.NewSubscriber(db, cfg, nil)
		if err != nil {
			return nil, err
		}
		// The forwarder's router closes the subscriber; closing it a second
		// time races inside watermill-sql (its closed flag is not
		// synchronised), so nobody else does.
		return wmforwarder.NewForwarder(sub, out, watermill.NopLogger{}, wmforwarder.Config{ForwarderTopic: wmForwarderTopic})
	default:
		cfg := forwarder.Config{DisablePrefetch: kind == relayOursNoPF || kind == relayOursTunedNoPF}
		switch kind {
		case relayOursTuned, relayOursTunedNoPF:
			cfg.BatchSize = ourTunedBatch
		case relayOursB100:
			cfg.BatchSize = minimalBatchSize // set alone: fixed, no growth to MaxBatchSize
		case relayOursLanes:
			cfg.Fence = forwarder.FenceLanes
		}
		if listen {
			cfg.ListenURL = s.url
		}
		return forwarder.New(db, out, nil, cfg)
	}
}

// runMinimal is the minimal SKIP LOCKED relay. It polls every 10ms when
// idle (it is only measured draining a backlog).
func runMinimal(ctx context.Context, db *sql.DB, out message.Publisher, batch int) error {
	for ctx.Err() == nil {
		n, err := minimalPass(ctx, db, out, batch)
		if err != nil && ctx.Err() == nil {
			return err
		}
		if n == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	return nil
}

func minimalPass(ctx context.Context, db *sql.DB, out message.Publisher, batch int) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	rows, err := tx.QueryContext(ctx, minimalClaim, batch)
	if err != nil {
		return 0, err
	}
	var ids []string
	byTopic := map[string][]*message.Message{}
	for rows.Next() {
		var id, dest string
		var payload []byte
		if err := rows.Scan(&id, &dest, &payload); err != nil {
			_ = rows.Close()
			return 0, err
		}
		ids = append(ids, id)
		byTopic[dest] = append(byTopic[dest], message.NewMessage(id, payload))
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, nil
	}
	for topic, msgs := range byTopic {
		if err := out.Publish(topic, msgs...); err != nil {
			return 0, err
		}
	}
	if _, err := tx.ExecContext(ctx, minimalDone, pq.Array(ids)); err != nil {
		return 0, err
	}
	return len(ids), tx.Commit()
}

// fillFor prepares the backlog a relay kind reads.
func fillFor(ctx context.Context, s *schema, kind string, n int, payload []byte) error {
	switch kind {
	case relayWMDefault, relayWMTuned:
		if err := initWatermillTables(ctx, s.db); err != nil {
			return err
		}
		return prefill(ctx, s.db, prefillWatermill, "wm-", n, payload)
	default:
		return prefill(ctx, s.db, prefillOutbox, "ob-", n, payload)
	}
}

// settle leaves nothing of what came before to the measurement that follows:
// a CHECKPOINT writes the prefill's dirty pages now rather than during the
// drain (an error, e.g. a role that may not checkpoint, only means it was not
// done), and the heap earlier cells left behind is collected and returned to
// the OS now, so the runtime does not return it during this cell's CPU
// reading (seen in profiles: madvise from the background scavenger, charged
// to whichever cell ran next).
func settle(ctx context.Context, db *sql.DB) {
	_, _ = db.ExecContext(ctx, "CHECKPOINT")
	debug.FreeOSMemory()
}

// drainStats is one drain cell's numbers.
type drainStats struct {
	rate        float64 // msg/s, from relay start to the last message received
	cpuUSPerMsg float64 // µs of this process's CPU (user + sys) per relayed message
	// versions and hot are the row versions the drain wrote per relayed
	// message (pg_stat_user_tables' n_tup_upd of the schema's outbox, read
	// once the relays' backends exited and their counts stopped moving),
	// and of those the HOT ones; 0 for watermill's relays (another table).
	versions, hot float64
	// walPerMsg is the WAL the drain wrote per relayed message:
	// pg_wal_lsn_diff of pg_current_wal_lsn() read after the fill and its
	// CHECKPOINT (settle), just before the relays start, and once every
	// row's terminal write committed, divided by the messages. The LSN is
	// the cluster's: anything else writing on the server meanwhile is
	// counted too. 0 for watermill's relays (not measured).
	walPerMsg float64
	// walOwnPerMsg is the part of that WAL that is this run's database's
	// (ownWAL): the server is shared, and other databases' WAL lands in the
	// same range. 0 when it could not be read (no pg_walinspect, or the
	// range's segments were recycled by a checkpoint meanwhile).
	walOwnPerMsg float64
	// walOwnFPIPerMsg is the part of walOwnPerMsg that is full-page images:
	// the first write of each page after the CHECKPOINT that ends the fill
	// logs the whole page. It depends on where a checkpoint falls: rows
	// relayed in the checkpoint cycle that wrote them (the steady state)
	// cost none; a backlog that waited across a checkpoint costs a page
	// image per page, taken by whichever write touches the page first.
	walOwnFPIPerMsg float64
	walOwnErr       error
}

// drainCell measures how fast d.relays relays of d.kind drain a backlog of n
// rows into a GoChannel, from start to the last message received, and the
// process CPU spent meanwhile per message. With d.keys > 0 the backlog's
// rows carry d.keys ordering keys, interleaved in seq (row g has key
// 'k' || g % keys), and every message is checked for per-key order as it is
// published (orderCheck): a violation fails the cell.
func drainCell(ctx context.Context, e *env, d drainKind, n int, payload []byte, timeout time.Duration) (drainStats, error) {
	var st drainStats
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return st, err
	}
	defer s.drop()
	if d.kind == relayOursLanes {
		// The lanes' index, as `outboxctl lanes set 32` builds it.
		if err := fencing.SetLaneCount(ctx, s.db, 32, forwarder.DefaultMaxAttempts); err != nil {
			return st, err
		}
	}
	if d.keys > 0 {
		if err := prefillRows(ctx, s.db, "ob-", n, payload, keyedBy(d.keys), ""); err != nil {
			return st, err
		}
	} else if err := fillFor(ctx, s, d.kind, n, payload); err != nil {
		return st, err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	snk, err := newSink(sctx, n)
	if err != nil {
		return st, err
	}
	defer snk.close()
	var out message.Publisher = snk.ch
	var oc *orderCheck
	if d.keys > 0 {
		oc = newOrderCheck(snk.ch, "ob-", n)
		out = oc
	}
	settle(ctx, s.db)
	lsn0, err := walLSN(ctx, s.db)
	if err != nil {
		return st, err
	}
	cpu0 := processCPU()
	start := time.Now()
	r, err := startRelay(sctx, s, d.kind, d.relays, out, false)
	if err != nil {
		return st, err
	}
	defer r.stop()
	select {
	case <-snk.done:
	case <-time.After(timeout):
		return st, fmt.Errorf("%s: only %d of %d messages arrived within %s", d.name(), snk.count.Load(), n, timeout)
	}
	st.rate = float64(n) / time.Since(start).Seconds()
	st.cpuUSPerMsg = float64((processCPU() - cpu0).Microseconds()) / float64(n)
	if d.kind != relayWMDefault && d.kind != relayWMTuned {
		// Every row's terminal write committed before the relays stop (the
		// minimal relay's last batch would be rolled back by the stop),
		// then the relays' backends exit and report their counts.
		if err := waitPublished(ctx, s, n); err != nil {
			return st, fmt.Errorf("%s: %w", d.name(), err)
		}
		lsn1, err := walLSN(ctx, s.db)
		if err != nil {
			return st, fmt.Errorf("%s: %w", d.name(), err)
		}
		wal, err := walBetween(ctx, s.db, lsn0, lsn1)
		if err != nil {
			return st, fmt.Errorf("%s: %w", d.name(), err)
		}
		st.walPerMsg = wal / float64(n)
		r.stop()
		if own, fpi, err := e.ownWAL(ctx, lsn0, lsn1); err == nil {
			st.walOwnPerMsg, st.walOwnFPIPerMsg = own/float64(n), fpi/float64(n)
		} else {
			st.walOwnErr = err
		}
		upd, hot, err := rowVersions(ctx, s, n)
		if err != nil {
			return st, fmt.Errorf("%s: %w", d.name(), err)
		}
		st.versions, st.hot = float64(upd)/float64(n), float64(hot)/float64(n)
	}
	if oc != nil {
		if err := oc.violation(); err != nil {
			return st, fmt.Errorf("%s: PER-KEY ORDER VIOLATED: %w", d.name(), err)
		}
		if got := oc.firstDeliveries(); got != n {
			return st, fmt.Errorf("%s: %d distinct messages published, want %d", d.name(), got, n)
		}
	}
	return st, nil
}

// walLSN is the server's current WAL insert position.
func walLSN(ctx context.Context, db *sql.DB) (string, error) {
	var lsn string
	if err := db.QueryRowContext(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn); err != nil {
		return "", fmt.Errorf("pg_current_wal_lsn: %w", err)
	}
	return lsn, nil
}

// walBetween is the WAL bytes written on the server between two positions.
func walBetween(ctx context.Context, db *sql.DB, from, to string) (float64, error) {
	var b float64
	if err := db.QueryRowContext(ctx, `SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::float8`, from, to).Scan(&b); err != nil {
		return 0, fmt.Errorf("pg_wal_lsn_diff: %w", err)
	}
	return b, nil
}

// waitPublished waits until n rows of the schema's outbox are PUBLISHED,
// for at most 30 s.
func waitPublished(ctx context.Context, s *schema, n int) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		var done int
		if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM messaging_outbox WHERE published_at IS NOT NULL`).Scan(&done); err != nil {
			return err
		}
		if done >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d rows PUBLISHED 30 s after their delivery", done, n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// rowVersions reads how many row versions updates wrote in the schema's
// outbox for n relayed messages, and how many of them were HOT. Each relay
// backend reports its counts when it exits (or within a second of a
// commit), so it waits until every message's terminal write is counted (at
// least n: every relay writes each row at least once) and the counts stop
// moving, for at most 30 s.
func rowVersions(ctx context.Context, s *schema, n int) (upd, hot int64, err error) {
	const q = `SELECT coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0) FROM pg_stat_user_tables
 WHERE schemaname = $1 AND relname = 'messaging_outbox'`
	deadline := time.Now().Add(30 * time.Second)
	var last int64 = -1
	for stable := 0; stable < 3 && time.Now().Before(deadline); {
		if err := s.db.QueryRowContext(ctx, q, s.name).Scan(&upd, &hot); err != nil {
			return 0, 0, err
		}
		switch {
		case upd < int64(n):
			stable, last = 0, upd
		case upd == last:
			stable++
		default:
			stable, last = 0, upd
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	if upd < int64(n) {
		return upd, hot, fmt.Errorf("only %d row versions reported for %d relayed messages after 30 s", upd, n)
	}
	return upd, hot, nil
}
