// Outcomes: the fenced transitions out of a claim, written in one
// statement per batch.

package fencing

import (
	"context"
	"fmt"
	"strconv"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/lib/pq"
)

// Result says whether a fenced write took effect.
type Result int

const (
	// Applied: the lease was still current; the row moved.
	Applied Result = iota + 1
	// Stale: the row is no longer IN_FLIGHT under this owner and token (the
	// lease expired and another relay claimed it, or an operator moved it).
	// Nothing was written. If the message was sent, it may be a duplicate.
	Stale
)

func (r Result) String() string {
	switch r {
	case Applied:
		return "applied"
	case Stale:
		return "stale"
	}
	return fmt.Sprintf("Result(%d)", int(r))
}

// Outcome is one fenced transition for [Apply].
//
// To is the target state: PUBLISHED, AMBIGUOUS (retry at NextAttemptAt, or
// else RetryAfter after the statement's clock; both zero means immediately), FAILED or EXHAUSTED (parked, Code required), or PENDING
// meaning "release": the row was not attempted under this lease, or the
// downstream as a whole was unavailable, and goes back (PENDING if it never
// had an attempt, AMBIGUOUS otherwise) with its attempts not counted; a
// release with a Code records why in the failure columns, and a release
// with a RetryAfter is not claimable again before that delay. Every other transition counts one attempt.
type Outcome struct {
	Lease         Lease
	To            envelope.Status
	NextAttemptAt time.Time // AMBIGUOUS only
	// RetryAfter (AMBIGUOUS when NextAttemptAt is zero, and a release) is
	// added to the statement's clock (Now, or the server's now()), the clock the claim
	// compares next_attempt_at with: a backoff computed from the caller's
	// clock would be shortened or stretched by its skew. >= 0.
	RetryAfter time.Duration
	Code       string    // last_failure_code for AMBIGUOUS/FAILED/EXHAUSTED
	Detail     string    // human text, truncated to MaxFailureDetail
	Now        time.Time // zero: the server's now()
}

// The outcome statements find their rows with "message_id = ANY(ids)", one
// probe of the primary key per id, and look each row's lease and outcome up
// in a jsonb object keyed by message id (a binary search per row). They do
// not join the rows with a list of outcomes: a join's plan hangs on the
// estimate of how many rows are IN_FLIGHT under this owner, which the
// table's statistics rarely know (ANALYZE saw a moment with none, or an
// owner that did not exist yet). With that estimate at one row, PostgreSQL
// planned "scan the table for IN_FLIGHT rows of the owner, and for each one
// read the whole outcome list": with two batches of 1,000 rows in flight,
// 2,000 x 1,000 list rows and 320-790 ms per outcome write, against 7 ms by
// key. Custom plans (the first five executions on every connection, and
// every execution with DisablePreparedStatements) made that plan; generic
// plans did not (TestOutcomeStatementsReadOnlyTheirRows).

// The parts of an outcome statement that read the outcome of row o from
// the jsonb object $3 (u) at the batch's clock (c.t): its new status, then
// published_at, next_attempt_at, the failure columns and parked_at. Shared
// by applySQL and the lane scheme's statement.
const (
	outcomeStatus = `CASE WHEN u.to_status = 'PENDING'
                   THEN CASE WHEN o.attempts = 0 THEN 'PENDING' ELSE 'AMBIGUOUS' END
                   ELSE u.to_status END`
	outcomeColumns = `CASE WHEN u.to_status = 'PUBLISHED' THEN c.t ELSE o.published_at END,
              CASE WHEN u.to_status = 'AMBIGUOUS'
                   THEN coalesce(nullif(u.next_at, '')::timestamptz, c.t + u.retry_us * interval '1 microsecond')
                   WHEN u.to_status = 'PENDING' AND u.retry_us > 0 THEN c.t + u.retry_us * interval '1 microsecond'
                   WHEN u.to_status = 'PENDING' THEN o.next_attempt_at
                   ELSE NULL END,
              CASE WHEN u.to_status IN ('AMBIGUOUS', 'FAILED', 'EXHAUSTED')
                   THEN nullif(u.code, '')
                   ELSE coalesce(nullif(u.code, ''), o.last_failure_code) END,
              CASE WHEN u.to_status IN ('AMBIGUOUS', 'FAILED', 'EXHAUSTED')
                   THEN nullif(u.detail, '')
                   WHEN u.code <> '' THEN nullif(u.detail, '')
                   ELSE o.last_failure_detail END,
              CASE WHEN u.to_status IN ('FAILED', 'EXHAUSTED') THEN c.t ELSE o.parked_at END`
	outcomeSource = `FROM jsonb_to_record($3::jsonb -> o.message_id)
                AS u(to_status text, next_at text, code text, detail text, retry_us int8),
              (SELECT coalesce($1::timestamptz, now()) AS t) c`
)

// applySQL applies many fenced outcomes in one round trip; each row is
// matched on its own message id, owner and token ($3: {id: {"owner",
// "token", "to_status", "next_at", "code", "detail", "retry_us"}}), and the
// ids that matched come back. The whole batch shares one clock ($1), so it
// is one instant.
const applySQL = `
UPDATE messaging_outbox o
   SET (status, attempts, published_at, next_attempt_at, last_failure_code, last_failure_detail, parked_at) = (
       SELECT ` + outcomeStatus + `,
              o.attempts + CASE WHEN u.to_status = 'PENDING' THEN 0 ELSE 1 END,
              ` + outcomeColumns + `
         ` + outcomeSource + `),
       lease_expires_at = NULL
 WHERE o.message_id = ANY ($2::text[])
   AND o.status = 'IN_FLIGHT'
   AND o.lease_owner = $3::jsonb -> o.message_id ->> 'owner'
   AND o.lease_token = ($3::jsonb -> o.message_id ->> 'token')::int8
RETURNING o.message_id`

// applyPublishedSQL is applySQL for the common batch: every outcome is
// PUBLISHED and names the same owner. It makes exactly the same change
// (PUBLISHED, attempts + 1, published_at, next_attempt_at and lease_expires_at
// cleared, the failure columns and parked_at left alone) under the same
// fence, with the ids and their tokens ($4: {id: token}) instead of every
// outcome column and no CASE per column, so the server parses, binds and
// evaluates less per statement.
const applyPublishedSQL = `
UPDATE messaging_outbox o
   SET status = 'PUBLISHED',
       attempts = o.attempts + 1,
       published_at = coalesce($1::timestamptz, now()),
       next_attempt_at = NULL,
       lease_expires_at = NULL
 WHERE o.message_id = ANY ($3::text[])
   AND o.status = 'IN_FLIGHT'
   AND o.lease_owner = $2
   AND o.lease_token = ($4::jsonb ->> o.message_id)::int8
RETURNING o.message_id`

// Apply writes many fenced outcomes in one statement and returns one result
// per outcome, in input order. Outcomes must name distinct rows; all share
// the Now of the first outcome. A database error is returned as an error (no
// row moved: it is one statement); a lease that no longer matches is a
// [Stale] result, never an error.
func Apply(ctx context.Context, db DBTX, outcomes []Outcome) ([]Result, error) {
	const op = "fencing.Apply"
	if len(outcomes) == 0 {
		return nil, nil
	}
	n := len(outcomes)
	seen := make(map[string]int, n)
	for i, o := range outcomes {
		if err := checkOutcome(op, o); err != nil {
			return nil, err
		}
		if j, dup := seen[o.Lease.MessageID]; dup {
			return nil, outbox.Errorf(CodeInvalidArgument, op, "outcomes %d and %d both name row %s", j, i, o.Lease.MessageID)
		}
		seen[o.Lease.MessageID] = i
	}
	results := make([]Result, n)
	for i := range results {
		results[i] = Stale
	}
	var query string
	var args []any
	if lanes := outcomes[0].Lease.Lanes; lanes > 0 {
		// A lane lease's plain release writes nothing: the row is as it was
		// read. The rest are written under the lane fence.
		written := make([]Outcome, 0, n)
		for i, o := range outcomes {
			if o.Lease.Lanes != lanes || o.Lease.Owner != outcomes[0].Lease.Owner {
				return nil, outbox.Errorf(CodeInvalidArgument, op, "outcome %d: lane leases of one batch must come from one owner and one lane count", i)
			}
			if plainRelease(o) {
				results[i] = Applied
				continue
			}
			written = append(written, o)
		}
		if len(written) == 0 {
			return results, nil
		}
		query, args = laneApplyStatement(written, !allPublished(written))
	} else {
		for i, o := range outcomes {
			if o.Lease.Lanes != 0 {
				return nil, outbox.Errorf(CodeInvalidArgument, op, "outcome %d: a lane lease and a per-row lease in one batch", i)
			}
		}
		query, args = applyStatement(outcomes, !allPublished(outcomes))
	}
	rows, err := db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
		results[seen[id]] = Applied
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return results, nil
}

// allPublished reports whether applyPublishedSQL can carry the batch.
func allPublished(outcomes []Outcome) bool {
	for _, o := range outcomes {
		if o.To != envelope.StatusPublished || o.Lease.Owner != outcomes[0].Lease.Owner {
			return false
		}
	}
	return true
}

// applyStatement returns the outcome statement for outcomes and its
// arguments: applySQL when general, else applyPublishedSQL (every outcome
// PUBLISHED under one owner).
func applyStatement(outcomes []Outcome, general bool) (string, []any) {
	ids := make([]string, len(outcomes))
	for i, o := range outcomes {
		ids[i] = o.Lease.MessageID
	}
	if !general {
		var b jsonObject
		for _, o := range outcomes {
			b.key(o.Lease.MessageID)
			b.buf = strconv.AppendInt(b.buf, o.Lease.Token, 10)
		}
		return applyPublishedSQL, []any{nowArg(outcomes[0].Now), outcomes[0].Lease.Owner, pq.Array(ids), b.close()}
	}
	var b jsonObject
	for _, o := range outcomes {
		appendOutcome(&b, o)
	}
	return applySQL, []any{nowArg(outcomes[0].Now), pq.Array(ids), b.close()}
}

// appendOutcome adds o to the outcome object b as a member keyed by its
// message id: {"owner", "token", "to_status", "next_at", "code", "detail",
// "retry_us"}.
func appendOutcome(b *jsonObject, o Outcome) {
	{
		var next string
		var retry int64
		switch o.To {
		case envelope.StatusAmbiguous:
			if !o.NextAttemptAt.IsZero() {
				next = o.NextAttemptAt.UTC().Format(time.RFC3339Nano)
			}
			retry = o.RetryAfter.Microseconds()
		case envelope.StatusPending:
			retry = o.RetryAfter.Microseconds()
		}
		b.key(o.Lease.MessageID)
		b.buf = append(b.buf, `{"owner":`...)
		b.buf = appendJSONString(b.buf, o.Lease.Owner)
		b.buf = append(b.buf, `,"token":`...)
		b.buf = strconv.AppendInt(b.buf, o.Lease.Token, 10)
		b.buf = append(b.buf, `,"to_status":`...)
		b.buf = appendJSONString(b.buf, string(o.To))
		b.buf = append(b.buf, `,"next_at":`...)
		b.buf = appendJSONString(b.buf, next)
		b.buf = append(b.buf, `,"code":`...)
		b.buf = appendJSONString(b.buf, CleanText(o.Code, 200))
		b.buf = append(b.buf, `,"detail":`...)
		b.buf = appendJSONString(b.buf, CleanText(o.Detail, MaxFailureDetail))
		b.buf = append(b.buf, `,"retry_us":`...)
		b.buf = strconv.AppendInt(b.buf, retry, 10)
		b.buf = append(b.buf, '}')
	}
}

func checkOutcome(op string, o Outcome) error {
	switch {
	case o.Lease.MessageID == "" || o.Lease.Owner == "":
		return outbox.Errorf(CodeInvalidArgument, op, "outcome needs the lease's message id and owner (got %q, %q)", o.Lease.MessageID, o.Lease.Owner)
	case o.Lease.Token <= 0:
		return outbox.Errorf(CodeInvalidArgument, op, "row %s: lease token must be > 0 (a claimed row always has one), got %d", o.Lease.MessageID, o.Lease.Token)
	case o.RetryAfter < 0:
		return outbox.Errorf(CodeInvalidArgument, op, "row %s: retry delay must be >= 0, got %s", o.Lease.MessageID, o.RetryAfter)
	}
	switch o.To {
	case envelope.StatusPublished, envelope.StatusAmbiguous, envelope.StatusPending:
	case envelope.StatusFailed, envelope.StatusExhausted:
		if o.Code == "" {
			return outbox.Errorf(CodeInvalidArgument, op, "row %s: parking as %s needs a failure code", o.Lease.MessageID, o.To)
		}
	default:
		return outbox.Errorf(CodeInvalidArgument, op, "row %s: %q is not a state a lease holder can move a row to (PUBLISHED, AMBIGUOUS, FAILED, EXHAUSTED, or PENDING to release)", o.Lease.MessageID, o.To)
	}
	return nil
}

func one(ctx context.Context, db DBTX, o Outcome) (Result, error) {
	res, err := Apply(ctx, db, []Outcome{o})
	if err != nil {
		return 0, err
	}
	return res[0], nil
}

// MarkPublished records a confirmed publish: PUBLISHED, published_at = now,
// attempts + 1, lease cleared. now may be zero (server time).
func MarkPublished(ctx context.Context, db DBTX, l Lease, now time.Time) (Result, error) {
	return one(ctx, db, Outcome{Lease: l, To: envelope.StatusPublished, Now: now})
}

// MarkAmbiguous records an attempt whose outcome is unknown: AMBIGUOUS, to be
// claimed again at next (zero: immediately), attempts + 1, failure code and
// bounded detail recorded.
func MarkAmbiguous(ctx context.Context, db DBTX, l Lease, next time.Time, code, detail string, now time.Time) (Result, error) {
	return one(ctx, db, Outcome{Lease: l, To: envelope.StatusAmbiguous, NextAttemptAt: next, Code: code, Detail: detail, Now: now})
}

// MarkExhausted parks a row whose attempt budget is spent: EXHAUSTED,
// parked_at = now, attempts + 1, code required.
func MarkExhausted(ctx context.Context, db DBTX, l Lease, code, detail string, now time.Time) (Result, error) {
	return one(ctx, db, Outcome{Lease: l, To: envelope.StatusExhausted, Code: code, Detail: detail, Now: now})
}

// MarkFailed parks a row the broker rejected for good (or that cannot be
// turned into a message): FAILED, parked_at = now, attempts + 1, code
// required.
func MarkFailed(ctx context.Context, db DBTX, l Lease, code, detail string, now time.Time) (Result, error) {
	return one(ctx, db, Outcome{Lease: l, To: envelope.StatusFailed, Code: code, Detail: detail, Now: now})
}

// Release gives back a row that was claimed but not attempted (a relay
// stopping, or a lease too short to start another publish): no attempt is
// counted and the row is claimable again at once.
func Release(ctx context.Context, db DBTX, l Lease, now time.Time) (Result, error) {
	return one(ctx, db, Outcome{Lease: l, To: envelope.StatusPending, Now: now})
}
