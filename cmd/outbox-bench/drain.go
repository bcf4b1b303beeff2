package main

import (
	"context"
	"database/sql"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

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
	// serverUSPerMsg: µs of the database server's CPU per relayed message
	// (serverCPU; 0 when the server does not run on this machine).
	serverUSPerMsg float64
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
// process CPU spent meanwhile per message. With d.keys = mixKeys the
// backlog is mixedKeys' (hot keys, small keys and rows without a key),
// checked for per-key order as below. With d.keys > 0 the backlog's
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
	if d.kind == relayOursLanes || d.kind == relayOursLanesShare {
		// The lanes' index, as `outboxctl lanes set 32` builds it.
		if err := fencing.SetLaneCount(ctx, s.db, 32, forwarder.DefaultMaxAttempts); err != nil {
			return st, err
		}
	}
	switch {
	case d.keys == mixKeys:
		if err := prefillRows(ctx, s.db, "ob-", n, payload, mixedKeys, ""); err != nil {
			return st, err
		}
	case d.keys > 0:
		if err := prefillRows(ctx, s.db, "ob-", n, payload, keyedBy(d.keys), ""); err != nil {
			return st, err
		}
	default:
		if err := fillFor(ctx, s, d.kind, n, payload); err != nil {
			return st, err
		}
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
	if d.keys != 0 {
		oc = newOrderCheck(snk.ch, "ob-", n)
		oc.unkeyedToo = d.keys == mixKeys
		out = oc
	}
	settle(ctx, s.db)
	lsn0, err := walLSN(ctx, s.db)
	if err != nil {
		return st, err
	}
	srv := newServerCPU(ctx, s.db)
	cpu0, srv0 := processCPU(), srv.read()
	start := time.Now()
	r, err := startRelay(sctx, s, d.kind, d.relays, out, false)
	if err != nil {
		return st, err
	}
	defer r.stop()
	select {
	case <-snk.done:
	case err := <-r.failed:
		return st, fmt.Errorf("%s: a relay ended with %d of %d messages arrived: %w", d.name(), snk.count.Load(), n, err)
	case <-time.After(timeout):
		return st, fmt.Errorf("%s: only %d of %d messages arrived within %s", d.name(), snk.count.Load(), n, timeout)
	}
	st.rate = float64(n) / time.Since(start).Seconds()
	st.cpuUSPerMsg = float64((processCPU() - cpu0).Microseconds()) / float64(n)
	st.serverUSPerMsg = float64((srv.read() - srv0).Microseconds()) / float64(n)
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
