package journal

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Codes returned by this package, each beside the calls that return it.
const (
	// CodeAlreadyExecuted: Begin (and Redrive/Purge) on an operation whose
	// journal row is COMPLETED. An approval runs once.
	CodeAlreadyExecuted outbox.Code = "JOURNAL_ALREADY_EXECUTED"
	// CodeInFlight: Begin when the operation is STARTED under a live lease
	// of another owner, or when another replica took it over between Begin's
	// read and its conditional update.
	CodeInFlight outbox.Code = "JOURNAL_IN_FLIGHT"
	// CodeLeaseLost: Checkpoint, Complete, Fail or a batch of Redrive/Purge
	// by an owner whose lease token is no longer the row's (another replica
	// took the operation over). Nothing of the refused call was applied.
	CodeLeaseLost outbox.Code = "JOURNAL_LEASE_LOST"
	// CodeNotFound: Find for a ticket with no journal row.
	CodeNotFound outbox.Code = "JOURNAL_NOT_FOUND"
	// CodeTicketRequired: an empty approval ticket.
	CodeTicketRequired outbox.Code = "JOURNAL_TICKET_REQUIRED"
	// CodePlanMismatch: Begin with a ticket already bound to a different
	// plan digest (the same approval cannot run a different plan).
	CodePlanMismatch outbox.Code = "JOURNAL_PLAN_MISMATCH"
	// CodeInvalidFilter: a redrive or purge filter that names a status other
	// than FAILED or EXHAUSTED, an empty message id, or an empty time range.
	CodeInvalidFilter outbox.Code = "JOURNAL_INVALID_FILTER"
	// CodeOperationRequired: Begin with an empty operation name, or Approve
	// with an operation other than OpRedrive or OpPurge.
	CodeOperationRequired outbox.Code = "JOURNAL_OPERATION_REQUIRED"
	// CodeBatchFailed is not returned: it is the failure_code Redrive and
	// Purge record (with the error as failure_detail) when a batch, or the
	// count of rows ahead of the checkpoint that precedes the first batch,
	// fails for a reason other than a lost lease or a cancelled context. The
	// operation is then FAILED and any replica may resume it at once.
	CodeBatchFailed outbox.Code = "JOURNAL_BATCH_FAILED"
	// CodeNotApproved: Redrive or Purge with Config.RequireApproval and no
	// approval recorded for the ticket ([Journal.Approve]).
	CodeNotApproved outbox.Code = "JOURNAL_NOT_APPROVED"
	// CodeApprovalExceeded: more rows match the approved plan now than were
	// approved; the error gives both counts.
	CodeApprovalExceeded outbox.Code = "JOURNAL_APPROVAL_EXCEEDED"
	// CodeAlreadyApproved: Approve for a ticket that already has an
	// approval (one ticket, one approval, one row set).
	CodeAlreadyApproved outbox.Code = "JOURNAL_ALREADY_APPROVED"
)

// Sentinels for errors.Is.
var (
	ErrAlreadyExecuted   = &outbox.Error{Code: CodeAlreadyExecuted}
	ErrInFlight          = &outbox.Error{Code: CodeInFlight}
	ErrLeaseLost         = &outbox.Error{Code: CodeLeaseLost}
	ErrNotFound          = &outbox.Error{Code: CodeNotFound}
	ErrTicketRequired    = &outbox.Error{Code: CodeTicketRequired}
	ErrPlanMismatch      = &outbox.Error{Code: CodePlanMismatch}
	ErrInvalidFilter     = &outbox.Error{Code: CodeInvalidFilter}
	ErrOperationRequired = &outbox.Error{Code: CodeOperationRequired}
	ErrNotApproved       = &outbox.Error{Code: CodeNotApproved}
	ErrApprovalExceeded  = &outbox.Error{Code: CodeApprovalExceeded}
	ErrAlreadyApproved   = &outbox.Error{Code: CodeAlreadyApproved}
)

// Operation states (the state column).
const (
	StateStarted   = "STARTED"
	StateCompleted = "COMPLETED"
	StateFailed    = "FAILED"
)

// Defaults for zero Config fields.
const (
	DefaultLeaseDuration = 30 * time.Second
	DefaultBatchSize     = 500
)

// Config configures a [Journal]. Zero fields take the documented default.
type Config struct {
	// Owner identifies this replica in the journal. Zero means
	// "<hostname>-<pid>-<random>", unique per process. Two Journals with the
	// same Owner are the same replica: one may take over the other's live
	// operation (its lease token then fences the other out).
	Owner string
	// LeaseDuration is how long an operation stays this owner's without a
	// checkpoint. Every batch extends it. Zero means 30s.
	LeaseDuration time.Duration
	// BatchSize is how many rows one Redrive/Purge batch (one transaction
	// with its checkpoint) changes. Zero means 500.
	BatchSize int
	// Now is the clock for leases and timestamps. Nil means the database's
	// now().
	Now func() time.Time
	// RequireApproval makes Redrive and Purge refuse (JOURNAL_NOT_APPROVED)
	// a ticket with no approval recorded by [Journal.Approve]. With or
	// without it, a recorded approval binds its ticket's execution to the
	// approved row set and count. outboxctl always sets it.
	RequireApproval bool
	// ForceTakeover lets Begin take over an operation whose lease is still
	// live. The takeover is recorded (forced_by, with the login). Without it
	// a live operation resumes at once only for its owner under the login
	// that last ran it, and for anyone else once its lease ends.
	ForceTakeover bool
}

func (c Config) withDefaults() Config {
	if c.Owner == "" {
		host, _ := os.Hostname()
		b := make([]byte, 4)
		_, _ = rand.Read(b)
		c.Owner = fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b))
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = DefaultLeaseDuration
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	return c
}

// Validate reports an invalid field as OUTBOX_INVALID_CONFIG.
func (c Config) Validate() error {
	c = c.withDefaults()
	const op = "journal.Config.Validate"
	switch {
	case c.LeaseDuration < time.Second:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "LeaseDuration is %s; use at least 1s (or 0 for %s)", c.LeaseDuration, DefaultLeaseDuration)
	case c.BatchSize < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "BatchSize is %d; use a positive number (or 0 for %d)", c.BatchSize, DefaultBatchSize)
	}
	return nil
}

// Journal records admin operations in messaging_admin_operation and runs
// them at most once per approval across all replicas.
type Journal struct {
	db  *sql.DB
	cfg Config

	afterRead    func() // test hook: between Begin's read and its takeover UPDATE
	beforeCommit func() // test hook: a batch's transaction is done but not committed
}

// New returns a Journal, or OUTBOX_INVALID_CONFIG for a nil db or an invalid
// cfg.
func New(db *sql.DB, cfg Config) (*Journal, error) {
	if db == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "journal.New", "db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Journal{db: db, cfg: cfg.withDefaults()}, nil
}

// Owner is this replica's owner id.
func (j *Journal) Owner() string { return j.cfg.Owner }

// Record is a journal row as Find returns it.
type Record struct {
	Ticket         string
	Digest         string
	Operation      string
	Plan           []byte // canonical JSON of the plan
	State          string
	Owner          string
	LeaseToken     int64
	LeaseExpiresAt time.Time
	ItemsCompleted int64
	Checkpoint     string
	StartedAt      time.Time
	UpdatedAt      time.Time
	CompletedAt    time.Time // zero unless COMPLETED
	FailureCode    string
	FailureDetail  string
	// ExecutedBy lists the database login (session_user) of every begin
	// and takeover, in order; ForcedBy those that forced a takeover of a
	// live lease. A trigger keeps both: no client writes them.
	ExecutedBy []string
	ForcedBy   []string
}

// Every statement takes the clock as coalesce($now::timestamptz, now()), so
// lease expiry is testable without sleeping.
const (
	sqlInsert = `
INSERT INTO messaging_admin_operation
    (approval_ticket, plan_digest, operation, plan, state, owner, lease_token, lease_expires_at,
     items_completed, started_at, updated_at)
VALUES ($1, $2, $3, $4, 'STARTED', $5, 1,
     coalesce($6::timestamptz, now()) + make_interval(secs => $7), 0,
     coalesce($6::timestamptz, now()), coalesce($6::timestamptz, now()))
ON CONFLICT DO NOTHING
RETURNING lease_token, lease_expires_at, items_completed, coalesce(checkpoint, '')`

	sqlFind = `
SELECT approval_ticket, plan_digest, operation, plan, state, owner, lease_token, lease_expires_at,
       items_completed, coalesce(checkpoint, ''), started_at, updated_at, completed_at,
       coalesce(failure_code, ''), coalesce(failure_detail, ''),
       lease_expires_at > coalesce($2::timestamptz, now()),
       array_to_json(executed_by)::text, array_to_json(forced_by)::text,
       coalesce(executed_by[cardinality(executed_by)] = session_user, false)
  FROM messaging_admin_operation WHERE approval_ticket = $1`

	// The takeover is conditional on what Begin read (state, owner, token)
	// and re-checks, on the row as it is now, that the operation is still
	// takeable: a replica that took it over, or an owner that checkpointed
	// (extending its lease), in between makes this match nothing.
	sqlTakeOver = `
UPDATE messaging_admin_operation
   SET owner = $3, lease_token = lease_token + 1,
       lease_expires_at = coalesce($6::timestamptz, now()) + make_interval(secs => $7),
       state = 'STARTED', updated_at = coalesce($6::timestamptz, now()),
       failure_code = NULL, failure_detail = NULL,
       forced_by = CASE WHEN $9 AND state = 'STARTED' AND lease_expires_at > coalesce($6::timestamptz, now())
                        THEN forced_by || session_user::text ELSE forced_by END
 WHERE approval_ticket = $1 AND plan_digest = $2
   AND state = $4 AND lease_token = $5 AND owner = $8
   AND ($9 OR state = 'FAILED' OR lease_expires_at <= coalesce($6::timestamptz, now())
        OR (owner = $3 AND executed_by[cardinality(executed_by)] = session_user))
RETURNING lease_token, lease_expires_at, items_completed, coalesce(checkpoint, '')`

	// Fenced by owner + token + STARTED. items_completed only grows.
	sqlCheckpoint = `
UPDATE messaging_admin_operation
   SET items_completed = GREATEST(items_completed, $5), checkpoint = $6,
       lease_expires_at = coalesce($3::timestamptz, now()) + make_interval(secs => $4),
       updated_at = coalesce($3::timestamptz, now())
 WHERE approval_ticket = $1 AND plan_digest = $2 AND owner = $7 AND lease_token = $8 AND state = 'STARTED'
RETURNING items_completed, lease_expires_at`

	// Taken first in every batch transaction: it fails fast when the lease
	// is lost, and its row lock orders the batch against a takeover.
	sqlFence = `
SELECT 1 FROM messaging_admin_operation
 WHERE approval_ticket = $1 AND plan_digest = $2 AND owner = $3 AND lease_token = $4 AND state = 'STARTED'
   FOR UPDATE`

	sqlComplete = `
UPDATE messaging_admin_operation
   SET state = 'COMPLETED', completed_at = coalesce($3::timestamptz, now()), updated_at = coalesce($3::timestamptz, now())
 WHERE approval_ticket = $1 AND plan_digest = $2 AND owner = $4 AND lease_token = $5 AND state = 'STARTED'`

	// A failed operation releases its lease at once (lease_expires_at = now)
	// so any replica may take it over without waiting.
	sqlFail = `
UPDATE messaging_admin_operation
   SET state = 'FAILED', failure_code = $6, failure_detail = $7,
       lease_expires_at = coalesce($3::timestamptz, now()), updated_at = coalesce($3::timestamptz, now())
 WHERE approval_ticket = $1 AND plan_digest = $2 AND owner = $4 AND lease_token = $5 AND state = 'STARTED'`
)

func (j *Journal) now() any {
	if j.cfg.Now == nil {
		return nil
	}
	return j.cfg.Now()
}

// Begin starts (or resumes) the operation op with the given plan under an
// approval ticket. The plan is encoded as canonical JSON; its digest
// ([Digest]) and the ticket are the operation's identity.
//
// Exactly one replica wins an INSERT ... ON CONFLICT DO NOTHING. Otherwise
// the row is read and Begin returns JOURNAL_ALREADY_EXECUTED (COMPLETED),
// JOURNAL_PLAN_MISMATCH (the ticket is bound to another digest),
// JOURNAL_IN_FLIGHT (STARTED under another owner's live lease), or takes
// over a FAILED or lease-expired operation with a conditional UPDATE that
// itself returns JOURNAL_IN_FLIGHT if another replica got there first.
// JOURNAL_TICKET_REQUIRED and JOURNAL_OPERATION_REQUIRED refuse empty input.
func (j *Journal) Begin(ctx context.Context, ticket, op string, plan any) (*Run, error) {
	const opName = "journal.Begin"
	if ticket == "" {
		return nil, outbox.Errorf(CodeTicketRequired, opName, "an approval ticket is required for %q", op)
	}
	if op == "" {
		return nil, outbox.Errorf(CodeOperationRequired, opName, "the operation name is empty")
	}
	digest, canonical, err := Digest(op, plan)
	if err != nil {
		return nil, err
	}
	return j.begin(ctx, ticket, op, digest, canonical)
}

// begin is Begin for a plan already encoded: canonical is its JSON and digest
// its [Digest]. Redrive and Purge call it with the identity they computed once.
func (j *Journal) begin(ctx context.Context, ticket, op, digest string, canonical []byte) (*Run, error) {
	const opName = "journal.Begin"
	run := &Run{Ticket: ticket, Digest: digest, Operation: op, Owner: j.cfg.Owner}
	lease := j.cfg.LeaseDuration.Seconds()

	// Two rounds at most: the row we conflicted with may vanish (an operator
	// deleting journal rows) between the INSERT and the read.
	for range 2 {
		err := j.db.QueryRowContext(ctx, sqlInsert, ticket, digest, op, canonical, j.cfg.Owner, j.now(), lease).
			Scan(&run.LeaseToken, &run.LeaseExpiresAt, &run.ItemsCompleted, &run.Checkpoint)
		if err == nil {
			return run, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return nil, fmt.Errorf("journal: begin %s/%s: %w", ticket, op, err)
		}
		rec, live, mine, err := j.find(ctx, ticket)
		if outbox.CodeOf(err) == CodeNotFound {
			continue
		}
		if err != nil {
			return nil, err
		}
		switch {
		case rec.Digest != digest:
			return nil, outbox.Errorf(CodePlanMismatch, opName,
				"ticket %q approved plan %s (%s); this plan is %s (%s): get a new approval for a different plan",
				ticket, rec.Digest, rec.Operation, digest, op)
		case rec.State == StateCompleted:
			return nil, outbox.Errorf(CodeAlreadyExecuted, opName,
				"ticket %q already ran %s to completion (%d items) at %s", ticket, op, rec.ItemsCompleted, rec.CompletedAt.Format(time.RFC3339))
		case rec.State == StateStarted && live && !j.cfg.ForceTakeover && (rec.Owner != j.cfg.Owner || !mine):
			return nil, outbox.Errorf(CodeInFlight, opName,
				"ticket %q is running on %s (login %s) until %s; that owner under that login resumes it at once (from its checkpoint), any other once the lease ends, or now by forcing a takeover, which is recorded",
				ticket, rec.Owner, lastOf(rec.ExecutedBy), rec.LeaseExpiresAt.Format(time.RFC3339Nano))
		}
		if j.afterRead != nil {
			j.afterRead()
		}
		err = j.db.QueryRowContext(ctx, sqlTakeOver, ticket, digest, j.cfg.Owner, rec.State, rec.LeaseToken, j.now(), lease, rec.Owner, j.cfg.ForceTakeover).
			Scan(&run.LeaseToken, &run.LeaseExpiresAt, &run.ItemsCompleted, &run.Checkpoint)
		if errors.Is(err, sql.ErrNoRows) {
			return nil, outbox.Errorf(CodeInFlight, opName,
				"ticket %q was taken over by another replica while this one tried to", ticket)
		}
		if err != nil {
			return nil, fmt.Errorf("journal: take over %s/%s: %w", ticket, op, err)
		}
		run.TookOver = true
		return run, nil
	}
	return nil, outbox.Errorf(CodeInFlight, opName, "ticket %q: its journal row kept disappearing; retry", ticket)
}

// Find returns the journal row of a ticket, or JOURNAL_NOT_FOUND.
func (j *Journal) Find(ctx context.Context, ticket string) (Record, error) {
	if ticket == "" {
		return Record{}, outbox.Errorf(CodeTicketRequired, "journal.Find", "an approval ticket is required")
	}
	rec, _, _, err := j.find(ctx, ticket)
	return rec, err
}

func lastOf(s []string) string {
	if len(s) == 0 {
		return "?"
	}
	return s[len(s)-1]
}

func (j *Journal) find(ctx context.Context, ticket string) (Record, bool, bool, error) {
	var (
		r                Record
		completed        sql.NullTime
		live, mine       bool
		executed, forced string
	)
	err := j.db.QueryRowContext(ctx, sqlFind, ticket, j.now()).Scan(&r.Ticket, &r.Digest, &r.Operation, &r.Plan,
		&r.State, &r.Owner, &r.LeaseToken, &r.LeaseExpiresAt, &r.ItemsCompleted, &r.Checkpoint,
		&r.StartedAt, &r.UpdatedAt, &completed, &r.FailureCode, &r.FailureDetail, &live, &executed, &forced, &mine)
	if errors.Is(err, sql.ErrNoRows) {
		return Record{}, false, false, outbox.Errorf(CodeNotFound, "journal.Find", "no operation for ticket %q", ticket)
	}
	if err != nil {
		return Record{}, false, false, fmt.Errorf("journal: find %q: %w", ticket, err)
	}
	if err := json.Unmarshal([]byte(executed), &r.ExecutedBy); err != nil {
		return Record{}, false, false, fmt.Errorf("journal: find %q: executed_by: %w", ticket, err)
	}
	if err := json.Unmarshal([]byte(forced), &r.ForcedBy); err != nil {
		return Record{}, false, false, fmt.Errorf("journal: find %q: forced_by: %w", ticket, err)
	}
	r.CompletedAt = completed.Time
	return r, live, mine, nil
}
