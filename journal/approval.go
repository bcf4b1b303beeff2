package journal

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Approval is a plan recorded in the database before it runs
// (messaging_admin_approval): the ticket, the operation and filter digest,
// the row set the approver saw (MaxSeq, ParkedBefore) and the count approved
// as a ceiling, with the approver's login and the time, both written by the
// database.
type Approval struct {
	Ticket       string
	Operation    string
	Digest       string // the plan digest (operation and normalized filter)
	Filter       Filter
	MaxSeq       int64     // the highest seq matching at approval (0: none matched)
	ParkedBefore time.Time // only rows parked before this instant
	Count        int64     // rows matching at approval: the ceiling
	ApprovedBy   string    // session_user of the approving connection
	ApprovedAt   time.Time
}

const (
	sqlApprove = `
WITH m AS (
    SELECT coalesce(max(seq), 0) AS max_seq, count(*) AS n FROM messaging_outbox
     WHERE` + filterWhere + `
       AND seq > $10
)
INSERT INTO messaging_admin_approval (approval_ticket, operation, plan_digest, plan, max_seq, parked_before, approved_count)
SELECT $11, $12, $13, $14, m.max_seq, coalesce($15::timestamptz, now()), m.n FROM m
ON CONFLICT (approval_ticket) DO NOTHING
RETURNING max_seq, parked_before, approved_count, approved_by, approved_at`

	sqlFindApproval = `
SELECT approval_ticket, operation, plan_digest, plan, max_seq, parked_before, approved_count, approved_by, approved_at
  FROM messaging_admin_approval WHERE approval_ticket = $1`
)

// Approve records the approval of running op (OpRedrive or OpPurge) with
// filter under ticket: it counts the matching rows and records, in one
// statement, the highest matching seq, the instant (only rows parked before
// it are approved) and the count, as the login running it. The execution
// under this ticket then touches only those rows, and refuses
// (JOURNAL_APPROVAL_EXCEEDED) while more of them match than were approved.
// A ticket is approved once (JOURNAL_ALREADY_APPROVED). Grant INSERT on
// messaging_admin_approval to an approver role only, and the operators who
// execute cannot approve (docs/SECURITY.md).
func (j *Journal) Approve(ctx context.Context, ticket, op string, f Filter) (Approval, error) {
	const opName = "journal.Approve"
	if ticket == "" {
		return Approval{}, outbox.Errorf(CodeTicketRequired, opName, "an approval ticket is required")
	}
	if op != OpRedrive && op != OpPurge {
		return Approval{}, outbox.Errorf(CodeOperationRequired, opName, "operation %q is not %s or %s", op, OpRedrive, OpPurge)
	}
	p, err := prepare(op, f)
	if err != nil {
		return Approval{}, err
	}
	a := Approval{Ticket: ticket, Operation: op, Digest: p.plan.Digest, Filter: p.plan.Filter}
	args := append(append(make([]any, 0, len(p.args)+6), p.args...), 0, ticket, op, p.plan.Digest, p.canonical, j.now())
	err = j.db.QueryRowContext(ctx, sqlApprove, args...).Scan(&a.MaxSeq, &a.ParkedBefore, &a.Count, &a.ApprovedBy, &a.ApprovedAt)
	if errors.Is(err, sql.ErrNoRows) {
		prev, ferr := j.FindApproval(ctx, ticket)
		if ferr != nil {
			return Approval{}, ferr
		}
		return prev, outbox.Errorf(CodeAlreadyApproved, opName, "ticket %q was approved by %s at %s (%s, %d rows, digest %s); a ticket is approved once",
			ticket, prev.ApprovedBy, prev.ApprovedAt.Format(time.RFC3339), prev.Operation, prev.Count, prev.Digest)
	}
	if err != nil {
		return Approval{}, fmt.Errorf("journal: approve %s: %w", ticket, err)
	}
	return a, nil
}

// FindApproval returns the approval recorded for ticket, or JOURNAL_NOT_APPROVED.
func (j *Journal) FindApproval(ctx context.Context, ticket string) (Approval, error) {
	var (
		a    Approval
		plan []byte
	)
	err := j.db.QueryRowContext(ctx, sqlFindApproval, ticket).Scan(&a.Ticket, &a.Operation, &a.Digest, &plan,
		&a.MaxSeq, &a.ParkedBefore, &a.Count, &a.ApprovedBy, &a.ApprovedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return Approval{}, outbox.Errorf(CodeNotApproved, "journal.FindApproval", "no approval is recorded for ticket %q", ticket)
	}
	if err != nil {
		return Approval{}, fmt.Errorf("journal: find approval %q: %w", ticket, err)
	}
	if err := json.Unmarshal(plan, &a.Filter); err != nil {
		return Approval{}, fmt.Errorf("journal: approval %q: plan: %w", ticket, err)
	}
	return a, nil
}

// bindApproval binds p to the approval recorded for ticket: the same plan,
// only its row set, and no more rows than approved, which it returns as the
// execution's ceiling. Without an approval it refuses when RequireApproval
// is set and binds nothing otherwise (ceiling -1: none).
func (j *Journal) bindApproval(ctx context.Context, ticket string, p *prepared) (int64, error) {
	opName := "journal." + p.plan.Operation
	a, err := j.FindApproval(ctx, ticket)
	if outbox.CodeOf(err) == CodeNotApproved {
		if j.cfg.RequireApproval {
			return 0, outbox.Errorf(CodeNotApproved, opName, "ticket %q has no recorded approval: an approver records it first (outboxctl %s ... --approve, or Journal.Approve)", ticket, p.plan.Operation)
		}
		return -1, nil
	}
	if err != nil {
		return 0, err
	}
	if a.Operation != p.plan.Operation || a.Digest != p.plan.Digest {
		return 0, outbox.Errorf(CodePlanMismatch, opName, "ticket %q approved plan %s (%s); this plan is %s (%s): get a new approval for a different plan",
			ticket, a.Digest, a.Operation, p.plan.Digest, p.plan.Operation)
	}
	p.args[7], p.args[8] = a.MaxSeq, a.ParkedBefore
	n, err := j.count(ctx, *p, 0)
	if err != nil {
		return 0, err
	}
	if n > a.Count {
		return 0, outbox.Errorf(CodeApprovalExceeded, opName, "ticket %q: %d rows match the approved row set now, %d were approved by %s at %s; get a new approval",
			ticket, n, a.Count, a.ApprovedBy, a.ApprovedAt.Format(time.RFC3339))
	}
	return a.Count, nil
}
