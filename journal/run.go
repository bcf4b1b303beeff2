package journal

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Run is one owner's hold on an operation. Its LeaseToken fences every later
// write: a replica that took the operation over has a larger token.
type Run struct {
	Ticket         string
	Digest         string
	Operation      string
	Owner          string
	LeaseToken     int64
	LeaseExpiresAt time.Time
	ItemsCompleted int64
	Checkpoint     string // opaque cursor of the last committed batch; "" before the first
	TookOver       bool   // true when Begin resumed a FAILED, lease-expired or own operation
}

type execQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Checkpoint records progress: items_completed becomes the larger of the
// stored value and itemsCompleted (it never goes backwards), the cursor is
// stored, and the lease is extended. JOURNAL_LEASE_LOST when run no longer
// holds the operation. Redrive and Purge checkpoint inside each batch
// transaction themselves; this is for callers running their own operation.
// A nil run is OUTBOX_INVALID_CONFIG.
func (j *Journal) Checkpoint(ctx context.Context, run *Run, itemsCompleted int64, cursor string) error {
	if run == nil {
		return nilRun("journal.Checkpoint")
	}
	return j.checkpoint(ctx, j.db, run, itemsCompleted, cursor)
}

func (j *Journal) checkpoint(ctx context.Context, q execQuerier, run *Run, items int64, cursor string) error {
	var got int64
	var exp time.Time
	err := q.QueryRowContext(ctx, sqlCheckpoint, run.Ticket, run.Digest, j.now(), j.cfg.LeaseDuration.Seconds(),
		items, cursor, run.Owner, run.LeaseToken).Scan(&got, &exp)
	if errors.Is(err, sql.ErrNoRows) {
		return lost("journal.Checkpoint", run)
	}
	if err != nil {
		return fmt.Errorf("journal: checkpoint %s: %w", run.Ticket, err)
	}
	run.ItemsCompleted, run.Checkpoint, run.LeaseExpiresAt = got, cursor, exp
	return nil
}

// Complete marks the operation COMPLETED: it can never run again under its
// ticket. JOURNAL_LEASE_LOST when run no longer holds it; a nil run is
// OUTBOX_INVALID_CONFIG.
func (j *Journal) Complete(ctx context.Context, run *Run) error {
	if run == nil {
		return nilRun("journal.Complete")
	}
	res, err := j.db.ExecContext(ctx, sqlComplete, run.Ticket, run.Digest, j.now(), run.Owner, run.LeaseToken)
	return j.fencedResult("journal.Complete", run, res, err)
}

// Fail marks the operation FAILED with a code and detail and releases its
// lease: any replica may take it over (resuming from its checkpoint) at
// once. JOURNAL_LEASE_LOST when run no longer holds it; a nil run is
// OUTBOX_INVALID_CONFIG.
func (j *Journal) Fail(ctx context.Context, run *Run, code, detail string) error {
	if run == nil {
		return nilRun("journal.Fail")
	}
	res, err := j.db.ExecContext(ctx, sqlFail, run.Ticket, run.Digest, j.now(), run.Owner, run.LeaseToken, code, detail)
	return j.fencedResult("journal.Fail", run, res, err)
}

func (j *Journal) fencedResult(op string, run *Run, res sql.Result, err error) error {
	if err != nil {
		return fmt.Errorf("%s %s: %w", op, run.Ticket, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("%s %s: %w", op, run.Ticket, err)
	}
	if n == 0 {
		return lost(op, run)
	}
	return nil
}

// nilRun refuses a nil *Run before any statement.
func nilRun(op string) error {
	return outbox.Errorf(outbox.CodeInvalidConfig, op, "run is nil; pass the *Run that Begin returned")
}

func lost(op string, run *Run) error {
	return outbox.Errorf(CodeLeaseLost, op, "ticket %q: owner %s with lease token %d no longer holds the operation",
		run.Ticket, run.Owner, run.LeaseToken)
}
