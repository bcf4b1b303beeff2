package fencing

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Codes returned by this package.
const (
	// CodeInvalidArgument: a claim or an outcome that cannot be executed as
	// given (empty owner, non-positive limit, unknown target state, the same
	// row twice in one batch).
	CodeInvalidArgument outbox.Code = "FENCING_INVALID_ARGUMENT"
	// CodeLeaseExpired is written to last_failure_code when a claim finds a
	// row whose lease expired before its holder wrote an outcome.
	CodeLeaseExpired = "LEASE_EXPIRED"
	// CodeBudgetSpent is written to last_failure_code when a claim finds a
	// PENDING or AMBIGUOUS row whose attempts already reach the budget (the
	// budget was lowered after they were spent) and parks it EXHAUSTED; the
	// detail keeps the code it had before.
	CodeBudgetSpent = "BUDGET_SPENT"
)

// ErrInvalidArgument matches CodeInvalidArgument with errors.Is.
var ErrInvalidArgument = &outbox.Error{Code: CodeInvalidArgument}

// MaxFailureDetail bounds last_failure_detail in bytes; longer text is cut at
// a rune boundary so a broker's multi-kilobyte error page cannot bloat rows.
const MaxFailureDetail = 1024

// DBTX is satisfied by *sql.DB, *sql.Tx and *sql.Conn.
type DBTX interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Lease is a relay's right to write the outcome of one row: valid while the
// row is IN_FLIGHT with this owner and token.
type Lease struct {
	MessageID string
	Owner     string
	Token     int64
	ExpiresAt time.Time
}

// OrderingPolicy says whether a parked row holds back later rows of its
// ordering key.
type OrderingPolicy int

const (
	// BlockKey (the default): a FAILED or EXHAUSTED row blocks every later row
	// with the same ordering key until it is redriven and published, or
	// purged. Consumers never see a gap in a key's sequence.
	BlockKey OrderingPolicy = iota
	// SkipParked: parked rows do not block their key; later rows are published
	// and the parked one, if redriven, arrives out of order.
	SkipParked
)

func (p OrderingPolicy) String() string {
	switch p {
	case BlockKey:
		return "block-key"
	case SkipParked:
		return "skip-parked"
	}
	return fmt.Sprintf("OrderingPolicy(%d)", int(p))
}

// Valid reports whether p is one of the declared policies.
func (p OrderingPolicy) Valid() bool { return p == BlockKey || p == SkipParked }

// ClaimParams configure one claim.
type ClaimParams struct {
	Owner       string         // lease owner written to the rows; required
	Limit       int            // at most this many rows; > 0
	Lease       time.Duration  // lease length from now; > 0
	MaxAttempts int            // attempt budget; > 0
	Policy      OrderingPolicy // per-key ordering policy
	Now         time.Time      // zero: the server's now()
	// FromSeq, when > 0, limits the claim to rows with seq >= FromSeq: the
	// index scan then starts there instead of at the claimable index's first
	// entry. A long drain leaves the entries of the rows it published at the
	// head of that index until VACUUM removes them, and a claim from the
	// start walks all of them (a 100-row claim: 0.86 ms on a fresh index,
	// 3.0 ms behind 290,000 published rows). Rows below FromSeq are not
	// considered at all, so a caller using it must also claim with 0 from
	// time to time (the forwarder does: see its documentation). >= 0.
	FromSeq int64
}

// Claimed is one row returned by [Claim].
//
// Row.Status is IN_FLIGHT for a row the caller now holds (Lease is valid), or
// EXHAUSTED for a row the claim parked instead (Lease is zero; report it, do
// not publish it): its expired lease spent the last attempt (LEASE_EXPIRED),
// or its attempts already reached a budget lowered since (BUDGET_SPENT).
//
// Row holds every column except four timestamps the claim does not return,
// which stay zero: published_at (NULL on every claimable row),
// next_attempt_at (the retry time that made the row due), last_attempt_at
// (this claim's now(), which Lease.ExpiresAt minus the lease duration gives)
// and parked_at (set on the rows it parks). Each costs a timestamp's text
// form on the server and a parse in the client on every claimed row, and no
// relay reads them; read the row by message_id when you need them.
//
// Err is non-nil when the row is held but cannot be decoded (for example its
// headers are not a flat string object: OUTBOX_CORRUPT_ROW); the identity
// fields and the lease are filled so the caller can park it with
// [MarkFailed].
type Claimed struct {
	Row   envelope.Row
	Lease Lease
	Err   error
}

// Held reports whether the caller holds the row and must write an outcome.
func (c Claimed) Held() bool { return c.Row.Status == envelope.StatusInFlight }

// The claim. The CTE is an index range scan on messaging_outbox_claimable_idx
// starting at seq $6 (its WHERE repeats the index predicate: "published_at IS
// NULL AND parked_at IS NULL" is the claimable set PENDING/AMBIGUOUS/IN_FLIGHT,
// an equivalence the table's CHECKs enforce; ORDER BY seq LIMIT n follows the
// index order), SKIP LOCKED makes concurrent claimers take disjoint rows, and
// the ordering check probes messaging_outbox_ordering_head_idx. The UPDATE
// runs on the server in the same statement, and the token is advanced by the
// database, not by the client.
//
// The UPDATE finds each picked row by its ctid (a TID scan) rather than by
// message_id (a primary-key descent per row, about an eighth of the claim's
// server time). The ctid is the locked version's: nobody else can change
// that version while the lock is held. In one race the TID scan finds
// nothing: a row changed by a transaction that committed after this
// statement's snapshot (another relay released it) is locked in its newest
// version, which the snapshot does not see. That row is then neither
// updated nor returned, keeps its state, and is claimed by a later pass; it
// is never returned without being marked.
const (
	claimHead = `
WITH picked AS (
    SELECT o.ctid AS picked_ctid, o.status = 'IN_FLIGHT' AS expired,
           CASE WHEN o.status = 'IN_FLIGHT' THEN o.attempts + 1 >= $4 ELSE o.attempts >= $4 END AS park
      FROM messaging_outbox o
     WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.seq >= $6
       AND (   (o.status <> 'IN_FLIGHT' AND o.attempts < $4
                AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= coalesce($1::timestamptz, now())))
            OR (o.status <> 'IN_FLIGHT' AND o.attempts >= $4)
            OR (o.status = 'IN_FLIGHT' AND o.lease_expires_at <= coalesce($1::timestamptz, now())))
       AND (o.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM messaging_outbox e
             WHERE e.ordering_key = o.ordering_key AND e.seq < o.seq
               AND e.published_at IS NULL`
	// Written on status, not as "e.parked_at IS NULL" (the same rows, by the
	// table's CHECK): with parked_at the probe would also match the
	// claimable index's predicate, and the planner may then walk every
	// earlier claimable row by seq instead of probing the key's entries in
	// messaging_outbox_ordering_head_idx.
	claimSkipParked = `
               AND e.status NOT IN ('FAILED', 'EXHAUSTED')`
	claimTail = `))
     ORDER BY o.seq
     LIMIT $5
       FOR UPDATE OF o SKIP LOCKED
)
UPDATE messaging_outbox o
   SET status = CASE WHEN p.park THEN 'EXHAUSTED' ELSE 'IN_FLIGHT' END,
       attempts = o.attempts + CASE WHEN p.expired THEN 1 ELSE 0 END,
       lease_owner = CASE WHEN p.park THEN o.lease_owner ELSE $2 END,
       lease_token = CASE WHEN p.park THEN o.lease_token ELSE o.lease_token + 1 END,
       lease_expires_at = CASE WHEN p.park THEN NULL
                               ELSE coalesce($1::timestamptz, now()) + make_interval(secs => $3) END,
       last_attempt_at = CASE WHEN p.park THEN o.last_attempt_at ELSE coalesce($1::timestamptz, now()) END,
       parked_at = CASE WHEN p.park THEN coalesce($1::timestamptz, now()) ELSE o.parked_at END,
       last_failure_code = CASE WHEN p.expired THEN '` + CodeLeaseExpired + `'
                                WHEN p.park THEN '` + CodeBudgetSpent + `'
                                ELSE o.last_failure_code END,
       last_failure_detail = CASE WHEN p.expired
           THEN 'lease of ' || coalesce(o.lease_owner, '?') || ' (token ' || o.lease_token || ') expired before an outcome was written'
           WHEN p.park
           THEN o.attempts || ' attempts already reach the budget of ' || $4 || '; last failure: '
                || coalesce(o.last_failure_code, 'none') || coalesce(': ' || o.last_failure_detail, '')
           ELSE o.last_failure_detail END
  FROM picked p
 WHERE o.ctid = p.picked_ctid
RETURNING ` + claimColumns

	// claimColumns is envelope.SelectColumns, in its order for
	// envelope.ScanRow, with the timestamps Claimed.Row leaves zero read as
	// NULL (TestClaimColumnsFollowSelectColumns keeps the two in step).
	claimColumns = `message_id, destination, payload, headers, status, seq, created_at,
occurred_at, NULL::timestamptz, attempts, NULL::timestamptz, lease_owner, lease_token,
lease_expires_at, last_failure_code, last_failure_detail, NULL::timestamptz, producer,
correlation_id, causation_id, tenant, partition_key, ordering_key, traceparent,
tracestate, baggage, schema_subject, schema_version, content_type, message_type,
aggregate_type, aggregate_id, aggregate_version, NULL::timestamptz, routing_key`

	// ClaimBlockKeySQL is the claim under [BlockKey].
	ClaimBlockKeySQL = claimHead + claimTail
	// ClaimSkipParkedSQL is the claim under [SkipParked].
	ClaimSkipParkedSQL = claimHead + claimSkipParked + claimTail
)

func nowArg(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

// Claim takes up to p.Limit claimable rows for p.Owner in one statement and
// returns them in seq order (see the package documentation for what is
// claimable). Rows come back IN_FLIGHT with a fresh lease, or EXHAUSTED when
// an expired lease spent the budget or the budget was already spent. Invalid parameters are refused with
// FENCING_INVALID_ARGUMENT before touching the database.
func Claim(ctx context.Context, db DBTX, p ClaimParams) ([]Claimed, error) {
	const op = "fencing.Claim"
	switch {
	case p.Owner == "":
		return nil, outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	case p.Limit <= 0:
		return nil, outbox.Errorf(CodeInvalidArgument, op, "limit must be > 0, got %d", p.Limit)
	case p.Lease <= 0:
		return nil, outbox.Errorf(CodeInvalidArgument, op, "lease must be > 0, got %s", p.Lease)
	case p.MaxAttempts <= 0:
		return nil, outbox.Errorf(CodeInvalidArgument, op, "max attempts must be > 0, got %d", p.MaxAttempts)
	case !p.Policy.Valid():
		return nil, outbox.Errorf(CodeInvalidArgument, op, "unknown ordering policy %d", int(p.Policy))
	case p.FromSeq < 0:
		return nil, outbox.Errorf(CodeInvalidArgument, op, "from seq must be >= 0, got %d", p.FromSeq)
	}
	q := ClaimBlockKeySQL
	if p.Policy == SkipParked {
		q = ClaimSkipParkedSQL
	}
	rows, err := db.QueryContext(ctx, q, nowArg(p.Now), p.Owner, p.Lease.Seconds(), p.MaxAttempts, p.Limit, p.FromSeq)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	defer rows.Close()
	out := make([]Claimed, 0, p.Limit)
	var rs envelope.RowScanner
	for rows.Next() {
		r, scanErr := rs.Scan(rows)
		if scanErr != nil && r.MessageID == "" {
			return nil, fmt.Errorf("%s: scan: %w", op, scanErr)
		}
		c := Claimed{Row: r, Err: scanErr}
		if r.Status == envelope.StatusInFlight {
			c.Lease = Lease{MessageID: r.MessageID, Owner: r.LeaseOwner, Token: r.LeaseToken, ExpiresAt: r.LeaseExpiresAt}
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	bySeq := func(a, b Claimed) int { return cmp.Compare(a.Row.Seq, b.Row.Seq) }
	if !slices.IsSortedFunc(out, bySeq) { // RETURNING has no order; usually it is the CTE's
		slices.SortFunc(out, bySeq)
	}
	return out, nil
}

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
// meaning "release": the row was not attempted under this lease and goes back
// unchanged (PENDING if it never had an attempt, AMBIGUOUS otherwise), its
// attempts not counted. Every other transition counts one attempt.
type Outcome struct {
	Lease         Lease
	To            envelope.Status
	NextAttemptAt time.Time // AMBIGUOUS only
	// RetryAfter (AMBIGUOUS only, when NextAttemptAt is zero) is added to the
	// statement's clock (Now, or the server's now()), the clock the claim
	// compares next_attempt_at with: a backoff computed from the caller's
	// clock would be shortened or stretched by its skew. >= 0.
	RetryAfter time.Duration
	Code       string    // last_failure_code for AMBIGUOUS/FAILED/EXHAUSTED
	Detail     string    // human text, truncated to MaxFailureDetail
	Now        time.Time // zero: the server's now()
}

// ApplySQL applies many fenced outcomes in one round trip; each row is
// matched on its own message id, owner and token, and the ids that matched
// come back. The whole batch shares one clock ($1), so it is one instant.
const ApplySQL = `
WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS t)
UPDATE messaging_outbox o
   SET status = CASE WHEN u.to_status = 'PENDING'
                     THEN CASE WHEN o.attempts = 0 THEN 'PENDING' ELSE 'AMBIGUOUS' END
                     ELSE u.to_status END,
       attempts = o.attempts + CASE WHEN u.to_status = 'PENDING' THEN 0 ELSE 1 END,
       published_at = CASE WHEN u.to_status = 'PUBLISHED' THEN c.t ELSE o.published_at END,
       next_attempt_at = CASE WHEN u.to_status = 'AMBIGUOUS'
                              THEN coalesce(nullif(u.next_at, '')::timestamptz, c.t + u.retry_us * interval '1 microsecond')
                              WHEN u.to_status = 'PENDING' THEN o.next_attempt_at
                              ELSE NULL END,
       lease_expires_at = NULL,
       last_failure_code = CASE WHEN u.to_status IN ('AMBIGUOUS', 'FAILED', 'EXHAUSTED')
                                THEN nullif(u.code, '') ELSE o.last_failure_code END,
       last_failure_detail = CASE WHEN u.to_status IN ('AMBIGUOUS', 'FAILED', 'EXHAUSTED')
                                  THEN nullif(u.detail, '') ELSE o.last_failure_detail END,
       parked_at = CASE WHEN u.to_status IN ('FAILED', 'EXHAUSTED') THEN c.t ELSE o.parked_at END
  FROM unnest($2::text[], $3::text[], $4::int8[], $5::text[], $6::text[], $7::text[], $8::text[], $9::int8[])
           AS u(id, owner, token, to_status, next_at, code, detail, retry_us),
       clock c
 WHERE o.message_id = u.id
   AND o.status = 'IN_FLIGHT'
   AND o.lease_owner = u.owner
   AND o.lease_token = u.token
RETURNING o.message_id`

// ApplyPublishedSQL is ApplySQL for the common batch: every outcome is
// PUBLISHED and names the same owner. It makes exactly the same change
// (PUBLISHED, attempts + 1, published_at, next_attempt_at and lease_expires_at
// cleared, the failure columns and parked_at left alone) under the same
// fence, with two array parameters instead of seven and no CASE per column,
// so the server parses, binds and evaluates less per statement.
const ApplyPublishedSQL = `
UPDATE messaging_outbox o
   SET status = 'PUBLISHED',
       attempts = o.attempts + 1,
       published_at = coalesce($1::timestamptz, now()),
       next_attempt_at = NULL,
       lease_expires_at = NULL
  FROM unnest($3::text[], $4::int8[]) AS u(id, token)
 WHERE o.message_id = u.id
   AND o.status = 'IN_FLIGHT'
   AND o.lease_owner = $2
   AND o.lease_token = u.token
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
	ids, tokens := make([]string, n), make([]int64, n)
	for i, o := range outcomes {
		ids[i], tokens[i] = o.Lease.MessageID, o.Lease.Token
	}
	var rows *sql.Rows
	var err error
	if allPublished(outcomes) {
		// The common batch: only ids and tokens travel.
		rows, err = db.QueryContext(ctx, ApplyPublishedSQL, nowArg(outcomes[0].Now), outcomes[0].Lease.Owner, pq.Array(ids), pq.Array(tokens))
	} else {
		owners, tos, nexts, codes, details := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		retries := make([]int64, n)
		for i, o := range outcomes {
			owners[i], tos[i] = o.Lease.Owner, string(o.To)
			if o.To == envelope.StatusAmbiguous {
				if !o.NextAttemptAt.IsZero() {
					nexts[i] = o.NextAttemptAt.UTC().Format(time.RFC3339Nano)
				}
				retries[i] = o.RetryAfter.Microseconds()
			}
			codes[i], details[i] = CleanText(o.Code, 200), CleanText(o.Detail, MaxFailureDetail)
		}
		rows, err = db.QueryContext(ctx, ApplySQL, nowArg(outcomes[0].Now),
			pq.Array(ids), pq.Array(owners), pq.Array(tokens), pq.Array(tos), pq.Array(nexts), pq.Array(codes), pq.Array(details), pq.Array(retries))
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	defer rows.Close()
	results := make([]Result, n)
	for i := range results {
		results[i] = Stale
	}
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

// allPublished reports whether ApplyPublishedSQL can carry the batch.
func allPublished(outcomes []Outcome) bool {
	for _, o := range outcomes {
		if o.To != envelope.StatusPublished || o.Lease.Owner != outcomes[0].Lease.Owner {
			return false
		}
	}
	return true
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

// CleanText makes s storable as text and bounded: NUL bytes (which
// PostgreSQL text cannot hold) and invalid UTF-8 become U+FFFD, and the
// result is cut to at most max bytes on a rune boundary.
func CleanText(s string, max int) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", "\uFFFD"), "\uFFFD")
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}
