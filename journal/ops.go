package journal

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// The operations this package runs through the journal.
const (
	OpRedrive = "redrive"
	OpPurge   = "purge"
)

// Digest returns the plan digest of op with plan: hex sha256 over the
// operation name, a newline and the plan's canonical JSON (encoding/json:
// struct fields in declaration order, map keys sorted), and that JSON.
func Digest(op string, plan any) (string, []byte, error) {
	if f, ok := plan.(Filter); ok {
		plan = f.Normalize()
	}
	return digestOf(op, plan)
}

// digestOf is Digest of a plan already in canonical form (a Filter already
// normalized): it encodes and hashes without normalizing again.
func digestOf(op string, plan any) (string, []byte, error) {
	canonical, err := json.Marshal(plan)
	if err != nil {
		return "", nil, fmt.Errorf("journal: encode plan of %s: %w", op, err)
	}
	h := sha256.New()
	h.Write([]byte(op))
	h.Write([]byte{'\n'})
	h.Write(canonical)
	return hex.EncodeToString(h.Sum(nil)), canonical, nil
}

const (
	// Counts what a walk from cursor $10 would still reach: the dry run
	// passes 0 (seq is an identity from 1), an executing call its checkpoint.
	sqlCount = `SELECT count(*) FROM messaging_outbox WHERE` + filterWhere + `
   AND seq > $10`

	// The picked ids reach the UPDATE/DELETE as an array (= ANY), which
	// plans as a primary-key Index Scan; a join with the CTE was planned as a
	// Seq Scan of the whole outbox (see retention's statements).
	//
	// Plain FOR UPDATE, not SKIP LOCKED: skipping a locked parked row would
	// move the cursor past it and skip it for good. Parked rows are not
	// claimed by relays, so the wait is short and rare.
	//
	// A redriven unkeyed row is claimable again, and may lie below its
	// lane's floor (migration 00052: where the lane relays' claims start
	// looking): every lane's floor is lowered to the batch's lowest
	// unkeyed seq in the same transaction (every lane's, so this package
	// need not know the lane expression; a redrive is rare, and the floors
	// rise again at the relays' next candidates), and their candidates are
	// dropped, by messaging_lower_lane_floors (migration 00052), which
	// runs as the schema's owner: the operator who redrives is not
	// granted the lanes. least() is evaluated on the lane row's newest
	// version, so a raise that commits first is lowered again; the lanes
	// are locked in lane order, as the relays lock them (fencing/floor.go).
	// The final SELECT joins floors' one row, so the call runs (a CTE that
	// writes nothing runs only when read).
	sqlRedriveBatch = `
WITH picked AS (
    SELECT message_id FROM messaging_outbox
     WHERE` + filterWhere + `
       AND seq > $10
     ORDER BY seq
     LIMIT $11
       FOR UPDATE
), changed AS (
    UPDATE messaging_outbox o
       SET status = 'PENDING', attempts = 0, next_attempt_at = coalesce($12::timestamptz, now()),
           parked_at = NULL, lease_owner = NULL, lease_expires_at = NULL
     WHERE o.message_id = ANY (ARRAY(SELECT message_id FROM picked))
    RETURNING o.seq, o.ordering_key IS NULL AS unkeyed
), floors AS (
    SELECT messaging_lower_lane_floors((SELECT min(c.seq) FROM changed c WHERE c.unkeyed)) AS lanes
)
SELECT count(*), coalesce(max(seq), $10) FROM changed, floors`

	sqlPurgeBatch = `
WITH picked AS (
    SELECT message_id FROM messaging_outbox
     WHERE` + filterWhere + `
       AND seq > $10
     ORDER BY seq
     LIMIT $11
       FOR UPDATE
), gone AS (
    DELETE FROM messaging_outbox o
     WHERE o.message_id = ANY (ARRAY(SELECT message_id FROM picked))
    RETURNING o.seq
)
SELECT count(*), coalesce(max(seq), $10) FROM gone`
)

// Plan is what an operation would do: its identity (operation, canonical
// filter, digest) and how many rows it covers.
type Plan struct {
	Operation string
	Filter    Filter // normalized
	Digest    string
	// Matching is, from PlanRedrive and PlanPurge, the rows matching the
	// filter when the plan was made. In an Outcome it is on the scale of
	// Outcome.Items: the operation's items_completed when this call began
	// (earlier owners and calls) plus the matching rows still ahead of its
	// checkpoint, counted right after Begin. For an operation that had not
	// started, both are the same count. Either is a snapshot: rows parked
	// later past the cursor are still walked.
	Matching int64
}

// Progress is reported after each committed batch.
type Progress struct {
	Ticket    string
	Operation string
	Batch     int   // batches committed by this call
	Items     int64 // items_completed of the operation (all owners, all calls)
	Planned   int64 // Outcome.Plan.Matching of this call: same scale as Items
}

// Options tune one Redrive or Purge call.
type Options struct {
	// Progress, when set, is called after each committed batch. Returning an
	// error stops the call with that error and leaves the operation STARTED
	// at its checkpoint, exactly as a crash would: it resumes (by this owner
	// at once, by another replica when the lease expires) where it stopped.
	Progress func(Progress) error
}

// Outcome reports a finished Redrive or Purge.
type Outcome struct {
	Plan    Plan
	Run     *Run
	Batches int   // batches committed by this call
	Items   int64 // items_completed of the operation, including earlier owners
}

// PlanRedrive returns the redrive plan for f without changing anything (the
// dry run): its digest and the number of rows it matches now.
func (j *Journal) PlanRedrive(ctx context.Context, f Filter) (Plan, error) {
	return j.plan(ctx, OpRedrive, f)
}

// PlanPurge is PlanRedrive for Purge.
func (j *Journal) PlanPurge(ctx context.Context, f Filter) (Plan, error) {
	return j.plan(ctx, OpPurge, f)
}

func (j *Journal) plan(ctx context.Context, op string, f Filter) (Plan, error) {
	p, err := prepare(op, f)
	if err != nil {
		return Plan{}, err
	}
	if p.plan.Matching, err = j.count(ctx, p, 0); err != nil {
		return Plan{}, err
	}
	return p.plan, nil
}

// prepared is one call's plan, worked out once: the filter validated and
// normalized, its canonical JSON and digest (the journal row's identity), and
// its bound statement parameters for the count and every batch.
type prepared struct {
	plan      Plan // Matching not counted yet
	canonical []byte
	args      []any // $1..$9
}

func prepare(op string, f Filter) (prepared, error) {
	if err := f.Validate(); err != nil {
		return prepared{}, err
	}
	n := f.Normalize()
	digest, canonical, err := digestOf(op, n)
	if err != nil {
		return prepared{}, err
	}
	return prepared{plan: Plan{Operation: op, Filter: n, Digest: digest}, canonical: canonical, args: n.bind()}, nil
}

// count returns how many rows match p's filter past cursor.
func (j *Journal) count(ctx context.Context, p prepared, cursor int64) (int64, error) {
	var n int64
	args := append(append(make([]any, 0, len(p.args)+1), p.args...), cursor)
	if err := j.db.QueryRowContext(ctx, sqlCount, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("journal: count %s: %w", p.plan.Operation, err)
	}
	return n, nil
}

// Redrive moves parked rows (FAILED and/or EXHAUSTED) matching f back to
// PENDING under the approval ticket: attempts = 0, next_attempt_at = now,
// parked_at and the lease (owner, expiry) cleared. lease_token is kept (it
// only ever grows, so a relay that still holds an old token stays fenced
// out), and last_failure_code/detail are kept so the operator can still see
// why the row was parked until its next attempt overwrites them.
//
// Rows are walked in seq order with a keyset cursor; each batch changes its
// rows and checkpoints (cursor, items) in one transaction, so a crash resumes
// exactly after the last committed batch. It returns Begin's refusals, and
// JOURNAL_LEASE_LOST if another replica took the operation over mid-way.
func (j *Journal) Redrive(ctx context.Context, ticket string, f Filter, opts Options) (Outcome, error) {
	return j.execute(ctx, OpRedrive, sqlRedriveBatch, ticket, f, opts)
}

// Purge deletes parked rows (FAILED and/or EXHAUSTED) matching f under the
// approval ticket, in checkpointed batches like Redrive.
func (j *Journal) Purge(ctx context.Context, ticket string, f Filter, opts Options) (Outcome, error) {
	return j.execute(ctx, OpPurge, sqlPurgeBatch, ticket, f, opts)
}

func (j *Journal) execute(ctx context.Context, op, batchSQL, ticket string, f Filter, opts Options) (Outcome, error) {
	if ticket == "" {
		return Outcome{}, outbox.Errorf(CodeTicketRequired, "journal."+op, "an approval ticket is required")
	}
	p, err := prepare(op, f)
	if err != nil {
		return Outcome{}, err
	}
	out := Outcome{Plan: p.plan}
	ceiling, err := j.bindApproval(ctx, ticket, &p)
	if err != nil {
		return out, err
	}
	run, err := j.begin(ctx, ticket, op, p.plan.Digest, p.canonical)
	if err != nil {
		return out, err
	}
	out.Run = run
	out.Items = run.ItemsCompleted

	release := func(err error) error {
		if ctx.Err() == nil && outbox.CodeOf(err) != CodeLeaseLost {
			// Release the operation for any replica to resume; a lost
			// lease is someone else's now, and a cancelled call is left
			// to its lease like a crash.
			_ = j.Fail(context.WithoutCancel(ctx), run, string(CodeBatchFailed), err.Error())
		}
		return err
	}
	var cursor int64
	if run.Checkpoint != "" {
		cursor, err = strconv.ParseInt(run.Checkpoint, 10, 64)
		if err != nil {
			return out, release(fmt.Errorf("journal: %s %s: checkpoint %q is not a seq cursor: %w", op, ticket, run.Checkpoint, err))
		}
	}
	// Counted after Begin, from the checkpoint Begin returned, so the total
	// is on the scale of Items: rows behind the cursor (done by an earlier
	// owner, or parked again since) are neither counted nor walked. A count
	// inside the first batch transaction would be no more exact (under READ
	// COMMITTED each statement has its own snapshot, and every batch is its
	// own transaction) and would hold the journal row lock while it scans.
	ahead, err := j.count(ctx, p, cursor)
	if err != nil {
		return out, release(err)
	}
	out.Plan.Matching = run.ItemsCompleted + ahead
	for {
		// An approved execution never touches more rows than were approved,
		// even when more join the approved row set while it runs (a row
		// parked by a transaction that began before the approval and
		// committed after it): its batches stop at the approved count.
		limit := int64(j.cfg.BatchSize)
		if ceiling >= 0 {
			if limit = min(limit, ceiling-run.ItemsCompleted); limit <= 0 {
				break
			}
		}
		n, next, err := j.batch(ctx, batchSQL, run, p.args, cursor, limit)
		if err != nil {
			return out, release(err)
		}
		out.Batches++
		out.Items = run.ItemsCompleted
		cursor = next
		if opts.Progress != nil {
			if err := opts.Progress(Progress{Ticket: ticket, Operation: op, Batch: out.Batches, Items: out.Items, Planned: out.Plan.Matching}); err != nil {
				return out, err
			}
		}
		if n < limit {
			break
		}
	}
	if err := j.Complete(ctx, run); err != nil {
		return out, err
	}
	return out, nil
}

// batch applies one batch and its checkpoint in one transaction.
func (j *Journal) batch(ctx context.Context, batchSQL string, run *Run, filterArgs []any, cursor, limit int64) (int64, int64, error) {
	tx, err := j.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = tx.Rollback() }()
	// Bound the waits of the batch, so that neither end can hang the other:
	// a row locked by another session fails the batch after half the lease
	// (lock_timeout; the operation is released, resumable) instead of
	// waiting for ever, and an executor that stops mid-batch (a frozen
	// process, a network partition) has its transaction ended by the server
	// once it sat idle for a lease, which releases the journal row for the
	// owner that takes over.
	lease := j.cfg.LeaseDuration.Milliseconds()
	if _, err := tx.ExecContext(ctx, `SELECT set_config('lock_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $2, true)`,
		strconv.FormatInt(max(1, lease/2), 10), strconv.FormatInt(lease, 10)); err != nil {
		return 0, 0, fmt.Errorf("journal: %s batch: %w", run.Operation, err)
	}
	var one int
	err = tx.QueryRowContext(ctx, sqlFence, run.Ticket, run.Digest, run.Owner, run.LeaseToken).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, 0, lost("journal."+run.Operation, run)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("journal: %s batch: %w", run.Operation, err)
	}
	args := append(append(make([]any, 0, len(filterArgs)+3), filterArgs...), cursor, limit)
	if run.Operation == OpRedrive {
		args = append(args, j.now()) // $12, the redriven rows' next_attempt_at
	}
	var n, next int64
	if err := tx.QueryRowContext(ctx, batchSQL, args...).Scan(&n, &next); err != nil {
		return 0, 0, fmt.Errorf("journal: %s batch: %w", run.Operation, err)
	}
	// Work on a copy: the run only advances if the transaction commits.
	staged := *run
	if err := j.checkpoint(ctx, tx, &staged, run.ItemsCompleted+n, strconv.FormatInt(next, 10)); err != nil {
		return 0, 0, err
	}
	if j.beforeCommit != nil {
		j.beforeCommit()
	}
	if err := tx.Commit(); err != nil {
		return 0, 0, fmt.Errorf("journal: %s batch commit: %w", run.Operation, err)
	}
	*run = staged
	return n, next, nil
}
