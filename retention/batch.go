package retention

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// The statements a run repeats in batches (see source).
const (
	// Each batch picks at most $2 ids under FOR UPDATE SKIP LOCKED (a row a
	// relay or another writer holds is skipped, never waited for) and deletes
	// exactly those. The status is checked again in the DELETE so that the
	// statement alone states the rule: only PUBLISHED rows go.
	//
	// "= ANY (ARRAY(SELECT ...))" rather than "USING picked": with USING, on
	// 20,000 rows PostgreSQL 15 planned a Hash Join over a Seq Scan of the
	// whole outbox for a 100-row batch (TestBatchStatementsUseIndexes), so a
	// batch's cost grew with the table. The array form is a primary-key
	// Index Scan. The inbox batch uses ctid the same way (a TID scan): its
	// key is composite, and the picked rows are locked, so their ctid cannot
	// change before the DELETE.
	pickPublished = `
    SELECT message_id FROM messaging_outbox
     WHERE status = 'PUBLISHED' AND published_at < coalesce($1::timestamptz, now()) - make_interval(secs => $3)
     ORDER BY published_at
     LIMIT $2
     FOR UPDATE SKIP LOCKED`
	// Re-checked by the DELETE itself, so the statement alone states the
	// rule: only PUBLISHED rows go.
	onlyPublished = ` AND o.status = 'PUBLISHED'`

	sqlDeletePublished = `
WITH picked AS (` + pickPublished + deletePicked + onlyPublished

	// ByCreatedAt reads no created_at index (there is none: it would cost an
	// entry on every insert and on every terminal write). It removes old rows
	// from the three partial indexes that together hold every row:
	//
	//   - the stream, rows never published nor parked (all rows, in CDC
	//     mode): messaging_outbox_claimable_idx in seq order, below $4, the
	//     seq of the first such row that is not yet old (sqlFirstYoungSeq,
	//     read once per run, and only among the first BatchSize x MaxBatches
	//     stream rows: a run cannot remove more, so a long backlog of old
	//     rows does not make the bound cost more than the run's own work;
	//     without a young row among them, one past the last of them).
	//     created_at is the inserting transaction's start and seq is taken
	//     at the insert, so a row inserted by a transaction that started
	//     before the horizon but inserted after a younger row is removed by
	//     a later run, late by at most that transaction's length;
	//   - parked rows: messaging_outbox_parked_idx, filtered by created_at
	//     (parked rows are few);
	//   - PUBLISHED rows (left from polling mode): the ByPublishedAt
	//     statement; published_at is never before created_at, so such a row
	//     goes once its published_at is past the horizon.
	sqlFirstYoungSeq = `
SELECT coalesce(min(seq) FILTER (WHERE created_at >= coalesce($1::timestamptz, now()) - make_interval(secs => $2)),
                max(seq) + 1, 0)
  FROM (SELECT seq, created_at FROM messaging_outbox
         WHERE published_at IS NULL AND parked_at IS NULL
         ORDER BY seq
         LIMIT $3) AS window_rows`

	pickStream = `
    SELECT message_id FROM messaging_outbox
     WHERE published_at IS NULL AND parked_at IS NULL AND seq < $4
       AND created_at < coalesce($1::timestamptz, now()) - make_interval(secs => $3)
     ORDER BY seq
     LIMIT $2
     FOR UPDATE SKIP LOCKED`
	pickParked = `
    SELECT message_id FROM messaging_outbox
     WHERE parked_at IS NOT NULL
       AND created_at < coalesce($1::timestamptz, now()) - make_interval(secs => $3)
     ORDER BY seq
     LIMIT $2
     FOR UPDATE SKIP LOCKED`

	deletePicked = `
)
DELETE FROM messaging_outbox o
 WHERE o.message_id = ANY (ARRAY(SELECT message_id FROM picked))`

	sqlDeleteStream = `
WITH picked AS (` + pickStream + deletePicked
	sqlDeleteParked = `
WITH picked AS (` + pickParked + deletePicked

	// The archive has the outbox's columns (routing_key and seq as plain
	// values): the envelope's column list is the one place they are named.
	archiveColumns = envelope.SelectColumns

	sqlDeleteInbox = `
WITH picked AS (
    SELECT ctid FROM messaging_inbox
     WHERE processed_at < coalesce($1::timestamptz, now()) - make_interval(secs => $3)
     ORDER BY processed_at
     LIMIT $2
     FOR UPDATE SKIP LOCKED
)
DELETE FROM messaging_inbox
 WHERE ctid = ANY (ARRAY(SELECT ctid FROM picked))`
)

// The archive's statements (see sqlArchivePublished).
var (
	// Archive mode: the delete and the insert are one statement, so a row is
	// either still in the outbox or in the archive, never in both or neither.
	//
	// A picked row whose message id the archive already holds is settled
	// per row, so one such id cannot fail every batch (rows go oldest
	// first, so it would be in the first batch of every run): with the same
	// message (every column the envelope carries: destination, payload,
	// headers and the metadata columns; not the bookkeeping of attempts,
	// leases and timestamps) the outbox row is deleted as archived and the
	// archive keeps its copy; with a different one the outbox row stays,
	// its status unchanged, marked RETENTION_ARCHIVE_CONFLICT with a detail
	// naming the id, and the archive picks skip it from then on (they read
	// it in the index and pass over it: a cost per conflicting row, not per
	// batch). It is not parked FAILED: that would take a delivered row back
	// into the unpublished set, where under BlockKey it would hold back
	// every later row of its ordering key, and a redrive would deliver it
	// again. The statement returns the rows moved, the rows inserted into
	// the archive and the conflicting ids.
	sqlArchivePublished = `
WITH picked AS (` + pickPublishedArchive + archivePicked + onlyPublished + archiveMoved

	archivePicked = `
), conflict AS (
    SELECT o.message_id, a.archived_at,
           (o.destination, o.payload, o.headers, o.occurred_at, o.producer, o.correlation_id, o.causation_id,
            o.tenant, o.partition_key, o.ordering_key, o.traceparent, o.tracestate, o.baggage,
            o.schema_subject, o.schema_version, o.content_type, o.message_type, o.aggregate_type,
            o.aggregate_id, o.aggregate_version)
           IS NOT DISTINCT FROM
           (a.destination, a.payload, a.headers, a.occurred_at, a.producer, a.correlation_id, a.causation_id,
            a.tenant, a.partition_key, a.ordering_key, a.traceparent, a.tracestate, a.baggage,
            a.schema_subject, a.schema_version, a.content_type, a.message_type, a.aggregate_type,
            a.aggregate_id, a.aggregate_version) AS same
      FROM messaging_outbox o
      JOIN messaging_outbox_archive a ON a.message_id = o.message_id
     WHERE o.message_id = ANY (ARRAY(SELECT message_id FROM picked))
       AND a.message_id = ANY (ARRAY(SELECT message_id FROM picked))
), moved AS (
    DELETE FROM messaging_outbox o
     WHERE o.message_id = ANY (ARRAY(SELECT message_id FROM picked))
       AND o.message_id <> ALL (ARRAY(SELECT message_id FROM conflict WHERE NOT same))`
	archiveMoved = `
    RETURNING o.*
), archived AS (
    INSERT INTO messaging_outbox_archive (` + archiveColumns + `, archived_at)
    SELECT ` + archiveColumns + `, coalesce($1::timestamptz, now()) FROM moved
     WHERE moved.message_id <> ALL (ARRAY(SELECT message_id FROM conflict))
    RETURNING 1
), set_aside AS (
    UPDATE messaging_outbox o
       SET last_failure_code = '` + CodeArchiveConflict + `',
           last_failure_detail = 'message ' || c.message_id || ' is already in messaging_outbox_archive (archived at '
               || c.archived_at || ') with different content; retention leaves this row in the outbox until one of the two is removed'
      FROM conflict c
     WHERE o.message_id = c.message_id AND NOT c.same
    RETURNING o.message_id
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM archived),
       (SELECT count(*) FROM set_aside), coalesce((SELECT string_agg(message_id, ', ') FROM set_aside), '')`

	sqlArchiveStream = `
WITH picked AS (` + pickStreamArchive + archivePicked + archiveMoved
	sqlArchiveParked = `
WITH picked AS (` + pickParkedArchive + archivePicked + archiveMoved

	// The archive's picks pass over rows set aside by an earlier conflict.
	pickPublishedArchive = notSetAside(pickPublished)
	pickStreamArchive    = notSetAside(pickStream)
	pickParkedArchive    = notSetAside(pickParked)
)

func notSetAside(pick string) string {
	const order = "\n     ORDER BY"
	if strings.Count(pick, order) != 1 {
		panic("retention: pick statement without one ORDER BY")
	}
	return strings.Replace(pick, order, "\n       AND last_failure_code IS DISTINCT FROM '"+CodeArchiveConflict+"'"+order, 1)
}

// source is one statement a run repeats in batches: $1 now, $2 batch size,
// $3 horizon in seconds, then args.
type source struct {
	query   string
	args    []any
	archive bool // returns (moved, inserted, conflicts, conflicting ids) instead of a row count
}

// outboxSources are the statements a run drains, in order. For ByCreatedAt
// it first reads the stream's bound on conn (see sqlFirstYoungSeq).
func (c *Cleaner) outboxSources(ctx context.Context, conn *sql.Conn) ([]source, error) {
	published := source{query: sqlDeletePublished}
	if c.cfg.Archive {
		published = source{query: sqlArchivePublished, archive: true}
	}
	if c.cfg.Mode != ByCreatedAt {
		return []source{published}, nil
	}
	bound, err := c.streamBound(ctx, conn)
	if err != nil {
		return nil, fmt.Errorf("read the stream's bound: %w", err)
	}
	stream, parked := source{query: sqlDeleteStream, args: []any{bound}}, source{query: sqlDeleteParked}
	if c.cfg.Archive {
		stream.query, parked.query = sqlArchiveStream, sqlArchiveParked
		stream.archive, parked.archive = true, true
	}
	return []source{stream, parked, published}, nil
}

// streamBound reads sqlFirstYoungSeq in its own transaction under the
// batches' statement timeout.
func (c *Cleaner) streamBound(ctx context.Context, conn *sql.Conn) (int64, error) {
	tx, err := conn.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, sqlStatementTimeout, strconv.FormatInt(c.cfg.StatementTimeout.Milliseconds(), 10)); err != nil {
		return 0, err
	}
	var bound int64
	window := int64(c.cfg.BatchSize) * int64(c.cfg.MaxBatches)
	if err := tx.QueryRowContext(ctx, sqlFirstYoungSeq, c.now(), c.cfg.Horizon.Seconds(), window).Scan(&bound); err != nil {
		return 0, err
	}
	return bound, tx.Commit()
}

// drain runs each source in batches until a batch comes back short, then
// the next source; MaxBatches bounds the batches of all sources together
// that found rows. A batch that finds none (an empty source: one index
// probe) is counted in batches but spends none of the budget, so an empty
// first source cannot use up a run and leave the rows of the next for ever.
func (c *Cleaner) drain(ctx context.Context, conn *sql.Conn, table string, sources []source, horizon time.Duration, res *Result) (batches, removed int, more bool, err error) {
	spent := 0
	for _, src := range sources {
		for {
			if spent == c.cfg.MaxBatches {
				return batches, removed, true, nil
			}
			n, set, err := c.batch(ctx, conn, table, src, horizon, batches+1, res)
			if err != nil {
				return batches, removed, false, fmt.Errorf("retention: %s batch %d: %w", table, batches+1, err)
			}
			batches++
			removed += n
			if n+set > 0 {
				spent++
			}
			if n+set < c.cfg.BatchSize {
				break
			}
		}
	}
	return batches, removed, false, nil
}

// batch runs one batch of src in its own transaction and returns the rows
// it removed and, in archive mode, the rows it set aside (conflicts).
func (c *Cleaner) batch(ctx context.Context, conn *sql.Conn, table string, src source, horizon time.Duration, number int, res *Result) (removed, setAside int, err error) {
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = tx.Rollback() }()
	timeout := strconv.FormatInt(c.cfg.StatementTimeout.Milliseconds(), 10)
	if _, err := tx.ExecContext(ctx, sqlStatementTimeout, timeout); err != nil {
		return 0, 0, err
	}
	args := append([]any{c.now(), c.cfg.BatchSize, horizon.Seconds()}, src.args...)
	var n64, inserted int64
	var conflicts int
	var ids string
	if src.archive {
		if err := tx.QueryRowContext(ctx, src.query, args...).Scan(&n64, &inserted, &conflicts, &ids); err != nil {
			return 0, 0, err
		}
	} else {
		r, err := tx.ExecContext(ctx, src.query, args...)
		if err != nil {
			return 0, 0, err
		}
		if n64, err = r.RowsAffected(); err != nil {
			return 0, 0, err
		}
		inserted = n64
	}
	b := Batch{Table: table, Number: number, Removed: int(n64)}
	if c.cfg.beforeCommit != nil {
		if err := c.cfg.beforeCommit(ctx, tx, b); err != nil {
			return 0, 0, err
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, 0, err
	}
	if res != nil {
		res.ArchiveDuplicates += int(n64 - inserted)
		res.ArchiveConflicts += conflicts
	}
	if conflicts > 0 {
		c.logger.Error("retention: message ids already archived with different content; their outbox rows stay, marked "+CodeArchiveConflict, nil, watermill.LogFields{
			"batch": number, "conflicts": conflicts, "message_ids": ids,
		})
	}
	if c.cfg.OnBatch != nil {
		c.cfg.OnBatch(b)
	}
	return b.Removed, conflicts, nil
}
