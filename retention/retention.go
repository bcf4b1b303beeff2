package retention

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

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
)

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

// now is the clock argument of every statement: NULL means the database's.
func (c *Cleaner) now() any {
	if c.cfg.Now != nil {
		return c.cfg.Now()
	}
	return nil
}

// Every calls Run now and then once per interval until ctx is done, handing
// each outcome to report (which may be nil). A failed run does not stop the
// loop. A run that ctx cut short is reported too when it committed a batch
// (its Result counts what committed, with ctx's error), so the report sums
// to what retention did. It returns ctx's error. Applications that prefer
// their own scheduler call Run instead; outboxctl cleanup calls Run once.
func (c *Cleaner) Every(ctx context.Context, interval time.Duration, report func(Result, error)) error {
	if interval <= 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, "retention.Cleaner.Every", "interval is %s; use a positive duration", interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		res, err := c.Run(ctx)
		if ctx.Err() != nil {
			if report != nil && res.Batches+res.InboxBatches > 0 {
				report(res, err)
			}
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
