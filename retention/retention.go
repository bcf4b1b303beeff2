package retention

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Mode selects which outbox rows count as old enough to remove.
type Mode string

const (
	// ByPublishedAt removes PUBLISHED rows whose published_at is past the
	// horizon. It never touches PENDING, IN_FLIGHT, AMBIGUOUS, FAILED or
	// EXHAUSTED rows. The right mode for the polling forwarder.
	ByPublishedAt Mode = "BY_PUBLISHED_AT"
	// ByCreatedAt removes rows whose created_at is past the horizon,
	// WHATEVER THEIR STATUS. It exists for CDC relay mode: a CDC connector
	// reads inserts from the WAL and never marks a row PUBLISHED, so in that
	// mode every row stays PENDING forever and ByPublishedAt would never
	// delete anything. Do not use it with the polling forwarder: it would
	// delete rows that were never published, and parked rows an operator
	// still has to look at, so Cleaner.Run refuses it (RELAY_MODE_CONFLICT)
	// unless the database's relay mode is CDC.
	ByCreatedAt Mode = "BY_CREATED_AT"
)

// CodeArchiveConflict is written to last_failure_code of an outbox row
// whose message id is already in messaging_outbox_archive with different
// content: archive mode leaves the row in the outbox (status unchanged) and
// the batch goes on; its last_failure_detail names the message id and when
// the other copy was archived. Later runs skip it until an operator resolves
// the conflict (see docs/BAD_INPUT.md).
const CodeArchiveConflict = "RETENTION_ARCHIVE_CONFLICT"

// Defaults applied by [Config.withDefaults] to zero fields.
const (
	DefaultHorizon          = 72 * time.Hour
	DefaultBatchSize        = 1000
	DefaultMaxBatches       = 100
	DefaultStatementTimeout = 5 * time.Second
	DefaultMode             = ByPublishedAt
	// MinInboxHorizon is the shortest InboxHorizon accepted without
	// AllowShortHorizons: a week, the default redelivery window of Pub/Sub
	// (message retention) and of Kafka (log retention). A consumer handed a
	// message again within that window must still find its id in the inbox,
	// or the message's effect is repeated.
	MinInboxHorizon = 7 * 24 * time.Hour
)

// CodeHorizonBelowFloor: Horizon is below DefaultHorizon, or InboxHorizon
// below MinInboxHorizon, and AllowShortHorizons is not set.
const CodeHorizonBelowFloor outbox.Code = "RETENTION_HORIZON_BELOW_FLOOR"

// ErrHorizonBelowFloor matches [CodeHorizonBelowFloor] with errors.Is.
var ErrHorizonBelowFloor = &outbox.Error{Code: CodeHorizonBelowFloor}

// Config configures a [Cleaner]. Zero fields take the documented default;
// negative values are refused by Validate.
type Config struct {
	// Horizon is how old a row must be to be removed. Zero means 72h.
	Horizon time.Duration
	// BatchSize is the most rows one batch (one transaction) removes.
	// Zero means 1000.
	BatchSize int
	// MaxBatches is the most batches that find rows one Run executes per
	// table (outbox and inbox each), so one run is bounded even with a huge
	// backlog; a batch that finds none (one index probe per source) is not
	// counted against it. Zero means 100. Result.More tells when the limit
	// stopped the run early.
	MaxBatches int
	// StatementTimeout is set with SET LOCAL inside each batch's own
	// transaction, so a batch that cannot finish in time is cancelled and
	// rolled back instead of holding its row locks. Zero means 5s. It is
	// sent in whole milliseconds, at least 1ms and at most 2147483647ms
	// (about 24.8 days, PostgreSQL's limit); Validate refuses others.
	StatementTimeout time.Duration
	// Mode chooses which rows are old. Zero means ByPublishedAt. CDC relay
	// mode needs ByCreatedAt (see the constant's documentation).
	Mode Mode
	// Archive moves the rows into messaging_outbox_archive (all columns,
	// plus archived_at) in the same statement instead of deleting them.
	Archive bool
	// InboxHorizon is how old (by processed_at) an inbox row must be to be
	// removed. Zero disables inbox cleanup: keep inbox ids at least as long as
	// a broker can redeliver a message, or its effect may be repeated.
	InboxHorizon time.Duration
	// AllowShortHorizons accepts a Horizon below DefaultHorizon and an
	// InboxHorizon below MinInboxHorizon, which Validate refuses otherwise
	// (RETENTION_HORIZON_BELOW_FLOOR): one typo (1ns for 1h) would delete
	// every published row and every inbox id. New logs each such Cleaner.
	AllowShortHorizons bool
	// Metrics, when set, is told every Run's result and error, skipped runs
	// included (retention/prommetrics implements it on Prometheus), so a
	// session that keeps the retention lock shows as runs skipped.
	Metrics Metrics
	// Now is the clock the horizons are measured from. Nil means the
	// database's now().
	Now func() time.Time
	// OnBatch, when set, is called after each batch commits (progress
	// reporting, metrics). It runs on the Run goroutine; keep it short.
	OnBatch func(Batch)

	// beforeCommit runs inside each batch transaction, after the delete and
	// before the commit (tests hold a batch open with it).
	beforeCommit func(ctx context.Context, tx *sql.Tx, b Batch) error
}

// Batch describes one committed (or about to commit) batch.
type Batch struct {
	Table   string // "messaging_outbox" or "messaging_inbox"
	Number  int    // 1-based within the table for this run
	Removed int    // rows deleted or archived by this batch
}

// Metrics receives the result of every Run (see Config.Metrics).
type Metrics interface {
	// RetentionRun is called once per Run, after it ends, with what Run
	// returns.
	RetentionRun(res Result, err error)
}

// Result reports one Run. More false does not promise that no row past the
// horizon remains under ByCreatedAt: an old stream row behind a younger one
// (its transaction started before the horizon and inserted later) waits for
// a later run.
type Result struct {
	// Skipped is true when another session held the run lock: the run did
	// nothing and is not an error, but a session that keeps the lock stops
	// retention; HeldBy names it (outboxctl cleanup exits 5).
	Skipped  bool
	Batches  int // outbox batches executed
	Deleted  int // outbox rows deleted (0 in archive mode)
	Archived int // outbox rows moved to the archive (0 in delete mode)
	// ArchiveDuplicates are outbox rows whose message id was already in the
	// archive with the same content: deleted from the outbox as archived
	// (included in Archived), the archive's copy kept.
	ArchiveDuplicates int
	// ArchiveConflicts are outbox rows whose message id was already in the
	// archive with different content: left in the outbox, marked
	// RETENTION_ARCHIVE_CONFLICT (see CodeArchiveConflict).
	ArchiveConflicts int
	InboxBatches     int  // inbox batches executed
	InboxDeleted     int  // inbox rows deleted
	More             bool // a table hit MaxBatches before its last source was drained: rows past the horizon may remain
	Duration         time.Duration
	// HeldBy, when Skipped, names the sessions holding the run lock ("pid N
	// (role, application)"), as far as pg_stat_activity shows them.
	HeldBy string
}

func (c Config) withDefaults() Config {
	if c.Horizon == 0 {
		c.Horizon = DefaultHorizon
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.MaxBatches == 0 {
		c.MaxBatches = DefaultMaxBatches
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = DefaultStatementTimeout
	}
	if c.Mode == "" {
		c.Mode = DefaultMode
	}
	return c
}

// Validate reports the first invalid field as OUTBOX_INVALID_CONFIG, after
// filling defaults.
func (c Config) Validate() error {
	c = c.withDefaults()
	const op = "retention.Config.Validate"
	switch {
	case c.Horizon < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "Horizon is %s; use a positive duration (or 0 for %s)", c.Horizon, DefaultHorizon)
	case c.BatchSize < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "BatchSize is %d; use a positive number (or 0 for %d)", c.BatchSize, DefaultBatchSize)
	case c.MaxBatches < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "MaxBatches is %d; use a positive number (or 0 for %d)", c.MaxBatches, DefaultMaxBatches)
	case c.StatementTimeout < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "StatementTimeout is %s; use a positive duration (or 0 for %s)", c.StatementTimeout, DefaultStatementTimeout)
	case c.StatementTimeout < time.Millisecond:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "StatementTimeout is %s; PostgreSQL counts it in whole milliseconds, use at least 1ms", c.StatementTimeout)
	case c.StatementTimeout.Milliseconds() > math.MaxInt32:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "StatementTimeout is %s; PostgreSQL's statement_timeout holds at most %dms (about 24.8 days), use at most that", c.StatementTimeout, math.MaxInt32)
	case c.InboxHorizon < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "InboxHorizon is %s; use a positive duration, or 0 to disable inbox cleanup", c.InboxHorizon)
	case !c.AllowShortHorizons && c.Horizon < DefaultHorizon:
		return outbox.Errorf(CodeHorizonBelowFloor, op, "Horizon is %s, below the floor of %s; set AllowShortHorizons (outboxctl: --allow-short-horizons) if that is meant", c.Horizon, DefaultHorizon)
	case !c.AllowShortHorizons && c.InboxHorizon > 0 && c.InboxHorizon < MinInboxHorizon:
		return outbox.Errorf(CodeHorizonBelowFloor, op, "InboxHorizon is %s, below the floor of %s (keep inbox ids as long as a broker can redeliver); set AllowShortHorizons (outboxctl: --allow-short-horizons) if that is meant", c.InboxHorizon, MinInboxHorizon)
	case c.Mode != ByPublishedAt && c.Mode != ByCreatedAt:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "Mode %q is unknown; use %s (polling relay) or %s (CDC relay)", c.Mode, ByPublishedAt, ByCreatedAt)
	}
	return nil
}

// Cleaner removes old outbox (and optionally inbox) rows in bounded batches.
// It is safe for concurrent use; concurrent runs, in this process or any
// other, serialise on a PostgreSQL advisory lock and the losers skip.
type Cleaner struct {
	db     *sql.DB
	logger watermill.LoggerAdapter
	cfg    Config
}

// New returns a Cleaner, or OUTBOX_INVALID_CONFIG when cfg is invalid or db
// is nil. A nil logger logs nothing.
func New(db *sql.DB, logger watermill.LoggerAdapter, cfg Config) (*Cleaner, error) {
	if db == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "retention.New", "db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	c := &Cleaner{db: db, logger: logger, cfg: cfg.withDefaults()}
	if c.cfg.Horizon < DefaultHorizon || (c.cfg.InboxHorizon > 0 && c.cfg.InboxHorizon < MinInboxHorizon) {
		logger.Info("retention horizons below the floor, allowed by AllowShortHorizons", watermill.LogFields{
			"severity": "warn", "horizon": c.cfg.Horizon, "inbox_horizon": c.cfg.InboxHorizon,
			"floor": DefaultHorizon, "inbox_floor": MinInboxHorizon,
		})
	}
	return c, nil
}

// Config returns the effective configuration (defaults filled in).
func (c *Cleaner) Config() Config { return c.cfg }

// The run lock is scoped to the outbox table the connection's search_path
// resolves (its oid), so cleaners of different schemas in one database do not
// exclude each other, while every replica of one deployment does.
const (
	sqlTryLock = `SELECT pg_try_advisory_lock(hashtextextended('watermill-outbox/retention/' || 'messaging_outbox'::regclass::oid::text, 0))`
	sqlUnlock  = `SELECT pg_advisory_unlock(hashtextextended('watermill-outbox/retention/' || 'messaging_outbox'::regclass::oid::text, 0))`
	// A bigint advisory key shows in pg_locks as classid (high half) and
	// objid (low half), objsubid 1.
	sqlLockHolder = `
SELECT coalesce(string_agg(format('pid %s (%s, %s)', l.pid, coalesce(a.usename::text, '?'), coalesce(nullif(a.application_name, ''), '-')), ', ' ORDER BY l.pid), '')
  FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended('watermill-outbox/retention/' || 'messaging_outbox'::regclass::oid::text, 0)`

	// set_config(..., true) is SET LOCAL with a bindable value.
	sqlStatementTimeout = `SELECT set_config('statement_timeout', $1, true)`

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

// Run executes one retention run: it takes the run lock on a dedicated
// connection (skipping, with Result.Skipped, when another run holds it), then
// removes outbox rows past the horizon in batches of at most BatchSize, each
// in its own transaction under StatementTimeout, until a batch comes back
// short or MaxBatches is reached; then the same for the inbox when
// InboxHorizon is set. Batches committed before an error stay committed.
//
// With ByCreatedAt, Run first reads the database's relay mode and refuses
// with RELAY_MODE_CONFLICT (relaymode.ErrRelayModeConflict), removing nothing,
// unless it is CDC: in polling mode that mode would delete undelivered and
// parked rows. The mode is read once per run, before the run lock.
func (c *Cleaner) Run(ctx context.Context) (res Result, err error) {
	if c.cfg.Metrics != nil {
		defer func() { c.cfg.Metrics.RetentionRun(res, err) }()
	}
	start := time.Now()
	defer func() { res.Duration = time.Since(start) }()

	if c.cfg.Mode == ByCreatedAt {
		if err := relaymode.RequireMode(ctx, c.db, relaymode.ModeCDC, "retention.Cleaner.Run",
			fmt.Sprintf("Mode %s removes rows of any status and is for CDC relay mode only (use %s, or switch with `outboxctl debezium enable`)", ByCreatedAt, ByPublishedAt)); err != nil {
			return res, err
		}
	}

	conn, err := c.db.Conn(ctx)
	if err != nil {
		return res, fmt.Errorf("retention: connection for the run lock: %w", err)
	}
	defer conn.Close()

	var locked bool
	if err := conn.QueryRowContext(ctx, sqlTryLock).Scan(&locked); err != nil {
		return res, fmt.Errorf("retention: run lock: %w", err)
	}
	if !locked {
		res.Skipped = true
		_ = conn.QueryRowContext(ctx, sqlLockHolder).Scan(&res.HeldBy)
		c.logger.Info("retention run skipped: another session holds the retention lock", watermill.LogFields{"held_by": res.HeldBy})
		return res, nil
	}
	defer func() {
		// The lock is session-level: if it cannot be released, the
		// connection must not go back to the pool still holding it.
		var released bool
		if uerr := conn.QueryRowContext(context.WithoutCancel(ctx), sqlUnlock).Scan(&released); uerr != nil || !released {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
	}()

	sources, err := c.outboxSources(ctx, conn)
	if err != nil {
		return res, fmt.Errorf("retention: %w", err)
	}
	var more bool
	res.Batches, res.Deleted, more, err = c.drain(ctx, conn, "messaging_outbox", sources, c.cfg.Horizon, &res)
	res.More = more
	if c.cfg.Archive {
		res.Archived, res.Deleted = res.Deleted, 0
	}
	if err != nil {
		return res, err
	}
	if c.cfg.InboxHorizon > 0 {
		res.InboxBatches, res.InboxDeleted, more, err = c.drain(ctx, conn, "messaging_inbox", []source{{query: sqlDeleteInbox}}, c.cfg.InboxHorizon, nil)
		res.More = res.More || more
		if err != nil {
			return res, err
		}
	}
	c.logger.Info("retention run finished", watermill.LogFields{
		"mode": string(c.cfg.Mode), "archive": c.cfg.Archive,
		"batches": res.Batches, "deleted": res.Deleted, "archived": res.Archived,
		"archive_duplicates": res.ArchiveDuplicates, "archive_conflicts": res.ArchiveConflicts,
		"inbox_batches": res.InboxBatches, "inbox_deleted": res.InboxDeleted, "more": res.More,
	})
	return res, nil
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

// now is the clock argument of every statement: NULL means the database's.
func (c *Cleaner) now() any {
	if c.cfg.Now != nil {
		return c.cfg.Now()
	}
	return nil
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

// Every calls Run now and then once per interval until ctx is done, handing
// each outcome to report (which may be nil). A failed run does not stop the
// loop. It returns ctx's error. Applications that prefer their own scheduler
// call Run instead; outboxctl cleanup calls Run once.
func (c *Cleaner) Every(ctx context.Context, interval time.Duration, report func(Result, error)) error {
	if interval <= 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, "retention.Cleaner.Every", "interval is %s; use a positive duration", interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		res, err := c.Run(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			c.logger.Error("retention run failed", err, nil)
		}
		if report != nil {
			report(res, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
