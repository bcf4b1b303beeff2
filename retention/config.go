package retention

import (
	"context"
	"database/sql"
	"math"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
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
