package fencing

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
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
//
// A lease held through a lane (Lanes > 0, from a claim with
// [ClaimParams].Lanes) is valid while the row's lane is still Owner's at
// epoch Token and the row still has Attempts: nothing of it is written on the
// row, and ExpiresAt is the lane's lease.
type Lease struct {
	MessageID string
	Owner     string
	Token     int64
	ExpiresAt time.Time
	// Lanes is the lane count of the table the lease was taken from, for a
	// lease held through a lane; 0 for a per-row lease.
	Lanes int
	// Attempts is the row's attempts when a lane lease was taken.
	Attempts int
}

// OrderingPolicy says whether a parked row holds back later rows of its
// ordering key.
type OrderingPolicy int

const (
	// BlockKey (the default): a FAILED or EXHAUSTED row blocks every later row
	// with the same ordering key until it is redriven and published, or
	// purged. No later row of the key overtakes a parked one; purging the
	// parked row does leave a gap in what consumers see.
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
	// FromSeq, when > 0, limits the unkeyed half of the claim to rows with
	// seq >= FromSeq: its index scan then starts there instead of at the
	// first entry. A long drain leaves the entries of the rows it published
	// at the head of that index until VACUUM removes them, and a claim from
	// the start walks all of them (a 100-row claim: 0.86 ms on a fresh
	// index, 3.0 ms behind 290,000 published rows). Unkeyed rows below
	// FromSeq are not considered at all, so a caller using it must also
	// claim with 0 from time to time (the forwarder does: see its
	// documentation). >= 0.
	FromSeq int64
	// KeyCursor is where the walk over ordering keys starts: the first key
	// after it, wrapping around to the smallest key once. Pass the
	// [NextKeyCursor] of the previous claim so that every key gets its turn
	// when there are more claimable keys than one claim takes. "" starts at
	// the smallest key.
	KeyCursor string
	// MaxChain bounds the rows the walk takes from one key it finds (0:
	// Limit). Shorter chains spread a batch over more keys, which a relay
	// publishes concurrently; longer ones cost fewer round trips on a hot
	// key.
	MaxChain int
	// MaxContinued bounds the rows this claim adds to one continued chain
	// (0: Limit). Continued chains grow one row per chain per step, so a
	// full batch is spread over them evenly.
	MaxContinued int
	// Continue extends chains the caller already holds (see [Continuation]).
	Continue []Continuation
	// NoKeyWalk leaves out the walk over keys (only Continue and, unless
	// NoUnkeyed, unkeyed rows are claimed).
	NoKeyWalk bool
	// NoUnkeyed leaves out rows without an ordering key.
	NoUnkeyed bool
	// ExcludeDestinations are destinations whose rows are not claimed (a
	// relay's open breakers): such a row is treated as not claimable, so it
	// also holds back the later rows of its ordering key.
	ExcludeDestinations []string
	// OnlyDestination, when set, claims rows of this destination only (a
	// breaker's probe).
	OnlyDestination string
	// MaxBytes bounds the claim by size: rows are taken in seq order while
	// the sum of their octet_length(payload) + pg_column_size(headers) stays
	// within it, and the first row is taken whatever its size, so a row
	// larger than the budget still goes out, alone. A chain cut by it is
	// still a prefix of its key's run. 0: no bound; >= 0.
	MaxBytes int64
	// Lanes, when set, claims in the lane scheme (see lanes.go): only rows
	// of these lanes, which Owner must own under a live lease (rows of the
	// others are not returned), read without writing them; the claim
	// records on each lane what Owner holds there. List them in the order
	// their unkeyed rows should be served (rotate it between claims).
	// LaneCount is then the table's lane count ([LaneCount]), and Held the
	// message ids Owner still holds from earlier claims (they are not
	// claimed again, and a continuation may follow one of them). Lease is
	// ignored: the lanes' leases bound the claim.
	Lanes     []int
	LaneCount int
	Held      []string
	// StrictBytes makes the first row fit MaxBytes too: for a statement
	// that completes a batch whose earlier statements spent part of the
	// budget, so that the batch as a whole stays within it (a row larger
	// than what is left waits for a claim of its own).
	StrictBytes bool
}

// Continuation asks a claim for the rows of Key right behind AfterSeq, a row
// (AfterID) that the caller holds IN_FLIGHT under the same owner, or that is
// already published. The caller must not publish them before it knows that
// AfterID and every earlier row it held of the key were confirmed: the claim
// takes them while those are still in flight.
type Continuation struct {
	Key      string
	AfterSeq int64
	AfterID  string
}

// NextKeyCursor returns the KeyCursor for the claim after one that started
// at prev and returned claimed: the last key its walk served, in walk order
// (keys after prev first, then, wrapped around, keys up to prev). Keys in
// continued were not walked and are ignored. When the walk served no key the
// cursor stays.
func NextKeyCursor(prev string, claimed []Claimed, continued []Continuation) string {
	var after, wrapped string
	var haveAfter, haveWrapped bool
	for _, c := range claimed {
		k, ok := c.Row.OrderingKey, c.Row.OrderingKey != ""
		if !ok || slices.ContainsFunc(continued, func(x Continuation) bool { return x.Key == k }) {
			continue
		}
		if k > prev {
			if !haveAfter || k > after {
				after, haveAfter = k, true
			}
		} else if !haveWrapped || k > wrapped {
			wrapped, haveWrapped = k, true
		}
	}
	switch {
	case haveWrapped:
		return wrapped
	case haveAfter:
		return after
	}
	return prev
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

// The claim is one statement with two halves, joined in seq order and cut at
// the limit.
//
// Unkeyed rows come from an index range scan on
// messaging_outbox_unkeyed_claimable_idx starting at seq $6 (its WHERE
// repeats the index predicate; ORDER BY seq LIMIT follows the index order),
// FOR UPDATE SKIP LOCKED, exactly as a SKIP LOCKED queue.
//
// Keyed rows come in chains. The claim walks the ordering keys that have
// unpublished rows, not the rows: a loose index scan over
// messaging_outbox_ordering_head_idx (one descent per key, "the next key
// after k"), starting after the key $7 where the relay's previous walk
// stopped and wrapping around once, so every key gets its turn. For each key
// it reads the head (the key's first unpublished row in seq order; under
// SkipParked the first unpublished and unparked one) and, only when the head
// is claimable, the run of rows right behind it (at most $8), cut at the
// first row that is not claimable and after a row the claim parks. A key
// whose head is in flight, parked, or waiting for its retry costs one
// descent and one heap read, whatever is queued behind it. The walk is
// lazy: it stops once it has found $13 rows.
//
// Continuations ($9-$11) extend chains this owner already holds: for each
// (key, after_seq, after_id), the run behind after_seq, provided the row
// after_id is still this owner's IN_FLIGHT row under a live lease, or
// already published. Keys
// being continued are left out of the walk. The runs are not capped at $8:
// the recursion adds one row to every run per step and stops at $5 rows, so
// one hot key fills a batch in one statement and several share it evenly.
//
// The chains are read without locks, then locked with SKIP LOCKED through
// their ctids (a TID scan); a row that another relay has locked or changed
// since this statement's snapshot is not returned (its new version fails
// the TID recheck) and ends its chain there. The lock step repeats the
// claimable test on the version it locked, but in its select list, not its
// WHERE: in the WHERE a generic plan may scan messaging_outbox_claimable_idx,
// whose predicate the test implies, instead of fetching the ctids (measured
// on a table not yet analyzed: 64 ms for a 100-key continuation instead of
// 1 ms); and the test must stay, because servers whose TID recheck does not
// compare the TID would otherwise lock and take the newer version of a row
// another relay just claimed. Only rows whose position in
// the chain equals their rank among the locked rows of their key are kept,
// so a chain is always a prefix of its key's claimable run and a row never
// goes out while an earlier row of its key is with someone else.
//
// The UPDATE finds each picked row by its ctid (a TID scan over the picked
// ctids: the second, redundant condition makes one available whatever join
// the planner picks, where it would otherwise join the picked rows to a
// sequential scan of the table) rather than by message_id (a primary-key
// descent per row). The ctid is the locked
// version's: nobody else can change that version while the lock is held. In
// one race the TID scan finds nothing: a row changed by a transaction that
// committed after this statement's snapshot (another relay released it) is
// locked in its newest version, which the snapshot does not see. That row is
// then neither updated nor returned, keeps its state, and is claimed by a
// later pass; it is never returned without being marked.

// claimable is the predicate "a relay may take this row now" on alias a.
func claimable(a string) string {
	return strings.NewReplacer("a.", a+".").Replace(`(a.published_at IS NULL AND a.parked_at IS NULL
         AND a.destination <> ALL($14::text[]) AND ($15::text = '' OR a.destination = $15::text) AND (
            (a.status <> 'IN_FLIGHT' AND (a.attempts >= $4 OR a.next_attempt_at IS NULL
                                          OR a.next_attempt_at <= coalesce($1::timestamptz, now())))
         OR (a.status = 'IN_FLIGHT' AND a.lease_expires_at <= coalesce($1::timestamptz, now()))))`)
}

// parks is "the claim parks this row instead of taking it" on alias a: an
// expired lease that spends the last attempt, or a budget already spent.
func parks(a string) string {
	return strings.NewReplacer("a.", a+".").Replace(
		`(CASE WHEN a.status = 'IN_FLIGHT' THEN a.attempts + 1 >= $4 ELSE a.attempts >= $4 END)`)
}

// walkCols are the columns the walks carry: enough to judge a row.
const walkCols = `x.ctid AS row_ctid, x.ordering_key AS k, x.seq, x.status, x.attempts, x.destination,
                x.next_attempt_at, x.lease_expires_at, x.published_at, x.parked_at, x.message_id, x.ordering_key`

// rowAfter is the next row of key k after seq s: one index descent on
// messaging_outbox_ordering_head_idx (ORDER BY ... LIMIT 1 is read from the
// index in order, never by a bitmap over every row of the key, whatever the
// planner believes about the key's size).
func rowAfter(k, s, notParked string) string {
	return `SELECT ` + walkCols + ` FROM messaging_outbox x
                 WHERE x.ordering_key = ` + k + ` AND x.seq > ` + s + ` AND x.published_at IS NULL` + notParked + `
                 ORDER BY x.ordering_key, x.seq LIMIT 1`
}

// headAfter is the head of the first key after k ("" for the first key at
// all): the first index entry past k, one descent.
func headAfter(k, notParked string) string {
	cond := "x.ordering_key IS NOT NULL"
	if k != "" {
		cond = "x.ordering_key > " + k
	}
	return `SELECT ` + walkCols + ` FROM messaging_outbox x
                 WHERE ` + cond + ` AND x.published_at IS NULL` + notParked + `
                 ORDER BY x.ordering_key, x.seq LIMIT 1`
}

// walkStep is the columns a walk row carries, from candidate row alias a.
func walkStep(a, pos, wrapped string, lanes int) string {
	return a + `.row_ctid, ` + a + `.k, ` + a + `.seq, ` + pos + ` AS pos, ` + wrapped + ` AS wrapped, ` +
		claimableIn(a, lanes) + ` AS take, ` + parks(a) + ` AS park`
}

// claimSQL is the claim statement under the walk's notParked condition:
// with lanes = 0 the per-row scheme (rows locked, then leased IN_FLIGHT),
// with lanes > 0 the lane scheme of a table with that many lanes (rows read
// without locks from the owner's lanes $18, except the rows it holds $19;
// see lanes.go).
func claimSQL(notParked string, lanes int) string {
	lockRows := `
       FOR UPDATE OF o SKIP LOCKED`
	heldAfter := `(p.status = 'IN_FLIGHT' AND p.lease_owner = $2
                                                                  AND p.lease_expires_at > coalesce($1::timestamptz, now()))`
	unkeyed := unkeyedHalf(lanes)
	finish := claimUpdate("picked")
	if lanes > 0 {
		lockRows, heldAfter = "", `p.message_id IN (SELECT unnest($19::text[]))`
		finish = laneClaimFinish("picked", lanes)
	}
	return `
WITH RECURSIVE walk(row_ctid, k, seq, pos, wrapped, take, park) AS (
    -- The head of the first key after the cursor ($7), or, wrapping, of the
    -- first key.
    SELECT ` + walkStep("f", "1", "f.wrapped", lanes) + ` FROM (
        (SELECT y.*, false AS wrapped FROM (` + headAfter("$7", notParked) + `) y)
        UNION ALL
        (SELECT y.*, true FROM (` + headAfter("", notParked) + `) y)
        LIMIT 1) f
     WHERE $13 > 0
  UNION ALL
    -- After a taken row that ends no chain: the next row of its key, if it
    -- can be taken; otherwise the head of the next key (wrapping once).
    SELECT n.* FROM walk c CROSS JOIN LATERAL (
        (SELECT ` + walkStep("y", "c.pos + 1", "c.wrapped", lanes) + ` FROM (` + rowAfter("c.k", "c.seq", notParked) + `) y
          WHERE c.take AND NOT c.park AND c.pos < $8 AND ` + claimableIn("y", lanes) + `)
        UNION ALL
        (SELECT ` + walkStep("y", "1", "c.wrapped", lanes) + ` FROM (` + headAfter("c.k", notParked) + `) y)
        UNION ALL
        (SELECT ` + walkStep("y", "1", "true", lanes) + ` FROM (` + headAfter("", notParked) + `) y WHERE NOT c.wrapped)
        LIMIT 1) n
     WHERE NOT (n.wrapped AND n.k > $7)
),
chains AS (
    SELECT row_ctid, k, seq, pos FROM walk
     WHERE take AND k <> ALL($9::text[])
     LIMIT $13
),
continued AS (
    WITH RECURSIVE run(row_ctid, k, seq, pos, wrapped, take, park) AS (
        SELECT ` + walkStep("y", "1", "false", lanes) + `
          FROM unnest($9::text[], $10::int8[], $11::text[]) AS ck(k, after_seq, after_id)
          CROSS JOIN LATERAL (` + rowAfter("ck.k", "ck.after_seq", notParked) + `) y
         WHERE ` + claimableIn("y", lanes) + `
           AND EXISTS (SELECT 1 FROM messaging_outbox p
                        WHERE p.message_id = ck.after_id AND p.ordering_key = ck.k AND p.seq = ck.after_seq
                          AND (p.published_at IS NOT NULL OR ` + heldAfter + `))
      UNION ALL
        SELECT ` + walkStep("y", "c.pos + 1", "false", lanes) + `
          FROM run c CROSS JOIN LATERAL (` + rowAfter("c.k", "c.seq", notParked) + `) y
         WHERE NOT c.park AND c.pos < $17 AND ` + claimableIn("y", lanes) + `
    )
    SELECT row_ctid, k, seq, pos FROM run LIMIT $5
),
candidates AS (
    SELECT * FROM chains UNION ALL SELECT * FROM continued
),
locked AS (
    SELECT o.ctid AS picked_ctid, o.seq, o.ordering_key AS k, ` + rowBytes + ` AS bytes,
           o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park,
           ` + claimableIn("o", lanes) + ` AS ok
      FROM messaging_outbox o
     WHERE o.ctid = ANY (ARRAY(SELECT row_ctid FROM candidates))` + lockRows + `
),
unkeyed AS (` + unkeyed + `
),
picked AS (
    SELECT u.picked_ctid, u.seq, u.bytes, u.expired, u.park FROM (
        SELECT picked_ctid, seq, bytes, expired, park FROM unkeyed
        UNION ALL
        SELECT picked_ctid, seq, bytes, expired, park
          FROM (SELECT l.*, c.pos, row_number() OVER (PARTITION BY l.k ORDER BY l.seq) AS rank
                  FROM locked l JOIN candidates c ON c.seq = l.seq
                 WHERE l.ok) r
         WHERE r.rank = r.pos
    ) u
    ORDER BY u.seq
    LIMIT $5
)
` + finish
}

// unkeyedHalf is the claim's unkeyed rows ($12 at most, from seq $6): one
// index range scan with SKIP LOCKED in the per-row scheme; in the lane
// scheme a range scan of messaging_outbox_lane_idx per lane of $18, in the
// array's order, stopping once $12 rows are found (the lanes are not merged
// in seq order: unkeyed rows have no order to keep, and a merge would read
// every lane's rows to return the first $12).
func unkeyedHalf(lanes int) string {
	if lanes == 0 {
		return `
    SELECT o.ctid AS picked_ctid, o.seq, ` + rowBytes + ` AS bytes, o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park
      FROM messaging_outbox o
     WHERE o.ordering_key IS NULL AND ` + claimable("o") + ` AND o.seq >= $6
     ORDER BY o.seq
     LIMIT $12
       FOR UPDATE OF o SKIP LOCKED`
	}
	return `
    SELECT u.* FROM unnest($18::int[]) AS ln(lane) CROSS JOIN LATERAL (
        SELECT o.ctid AS picked_ctid, o.seq, ` + rowBytes + ` AS bytes, o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park
          FROM messaging_outbox o
         WHERE ` + unkeyedLaneExpr("o", lanes) + ` = ln.lane
           AND o.ordering_key IS NULL AND ` + claimable("o") + ` AND o.message_id NOT IN (SELECT unnest($19::text[])) AND o.seq >= $6
         ORDER BY o.seq
         LIMIT $12) u
     LIMIT $12`
}

// rowBytes is what a row weighs against ClaimParams.MaxBytes, on alias o:
// neither function detoasts (octet_length of a bytea and pg_column_size read
// the stored length), so weighing costs no payload read.
const rowBytes = `(octet_length(o.payload) + pg_column_size(o.headers))::int8`

// claimUpdate is the UPDATE that marks the rows of CTE src (picked_ctid,
// seq, bytes, expired, park) IN_FLIGHT or parks them, and returns them. It
// first cuts src (in seq order) where the running sum of bytes would exceed
// the byte budget $16, keeping the first row whatever its size unless the
// budget is strict (passed negated: ClaimParams.StrictBytes).
func claimUpdate(src string) string {
	return strings.ReplaceAll(`, fits AS (
    SELECT b.picked_ctid, b.expired, b.park FROM (
        SELECT s.picked_ctid, s.expired, s.park,
               sum(s.bytes) OVER (ORDER BY s.seq ROWS UNBOUNDED PRECEDING) AS run,
               row_number() OVER (ORDER BY s.seq) AS n
          FROM {src} s) b
     WHERE $16::int8 = 0 OR (b.n = 1 AND $16::int8 > 0) OR b.run <= abs($16::int8)
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
       last_failure_code = CASE WHEN p.expired THEN '`+CodeLeaseExpired+`'
                                WHEN p.park THEN '`+CodeBudgetSpent+`'
                                ELSE o.last_failure_code END,
       last_failure_detail = CASE WHEN p.expired
           THEN 'lease of ' || coalesce(o.lease_owner, '?') || ' (token ' || o.lease_token || ') expired before an outcome was written'
           WHEN p.park
           THEN o.attempts || ' attempts already reach the budget of ' || $4 || '; last failure: '
                || coalesce(o.last_failure_code, 'none') || coalesce(': ' || o.last_failure_detail, '')
           ELSE o.last_failure_detail END
  FROM fits p
 WHERE o.ctid = p.picked_ctid
   AND o.ctid = ANY (ARRAY(SELECT picked_ctid FROM fits))
RETURNING `+claimColumns, "{src}", src)
}

// unkeyedClaimSQL is the claim without the walk over keys and without
// continuations: only its unkeyed half, one index range scan. Its
// parameters are numbered on their own ($1 now, $2 owner, $3 lease, $4
// budget, $5 limit, $6 from seq, $7 excluded destinations, $8 only
// destination, $9 byte budget). It exists because PostgreSQL plans the full claim afresh on
// every execution when no key has unpublished rows (its custom plans look so
// much cheaper than the generic one that the prepared statement never
// switches to the generic plan), and that planning costs milliseconds.
func unkeyedClaimSQL() string {
	q := `
WITH unkeyed AS (
    SELECT o.ctid AS picked_ctid, o.seq, ` + rowBytes + ` AS bytes, o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park
      FROM messaging_outbox o
     WHERE o.ordering_key IS NULL AND ` + claimable("o") + ` AND o.seq >= $6
     ORDER BY o.seq
     LIMIT $5
       FOR UPDATE OF o SKIP LOCKED
)
` + claimUpdate("unkeyed")
	return strings.NewReplacer("$14", "$7", "$15", "$8", "$16", "$9").Replace(q)
}

// claimColumns is envelope.SelectColumns, in its order for envelope.ScanRow,
// with the timestamps Claimed.Row leaves zero read as NULL
// (TestClaimColumnsFollowSelectColumns keeps the two in step).
const claimColumns = `message_id, destination, payload, headers, status, seq, created_at,
occurred_at, NULL::timestamptz, attempts, NULL::timestamptz, lease_owner, lease_token,
lease_expires_at, last_failure_code, last_failure_detail, NULL::timestamptz, producer,
correlation_id, causation_id, tenant, partition_key, ordering_key, traceparent,
tracestate, baggage, schema_subject, schema_version, content_type, message_type,
aggregate_type, aggregate_id, aggregate_version, NULL::timestamptz, routing_key`

// skipParked is the walks' condition under [SkipParked].
const skipParked = " AND x.status NOT IN ('FAILED', 'EXHAUSTED')"

var (
	// claimBlockKeySQL is the claim under [BlockKey].
	claimBlockKeySQL = claimSQL("", 0)
	// claimSkipParkedSQL is the claim under [SkipParked]: its walks step
	// over parked rows. Written on status, not as "parked_at IS NULL" (the
	// same rows, by the table's CHECK): with parked_at the walk's steps would
	// also match messaging_outbox_claimable_idx's predicate, and the planner
	// may then read a key's next row from that index instead of the ordering
	// index.
	claimSkipParkedSQL = claimSQL(skipParked, 0)
	// claimUnkeyedSQL is the claim of unkeyed rows only (NoKeyWalk without
	// continuations), under either policy.
	claimUnkeyedSQL = unkeyedClaimSQL()
)

func nowArg(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

// ClaimStatement returns the statement and arguments [Claim] runs for p,
// for EXPLAIN and for tools that need the plan of the claim a relay makes;
// p is validated as Claim validates it.
func ClaimStatement(p ClaimParams) (string, []any, error) {
	const op = "fencing.Claim"
	switch {
	case p.Owner == "":
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	case p.Limit <= 0:
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "limit must be > 0, got %d", p.Limit)
	case p.Lease <= 0 && p.Lanes == nil:
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "lease must be > 0, got %s", p.Lease)
	case p.MaxAttempts <= 0 || p.MaxAttempts > math.MaxInt32:
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "max attempts must be between 1 and %d (the attempts column is an integer), got %d", math.MaxInt32, p.MaxAttempts)
	case !p.Policy.Valid():
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "unknown ordering policy %d", int(p.Policy))
	case p.FromSeq < 0:
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "from seq must be >= 0, got %d", p.FromSeq)
	case p.MaxChain < 0:
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "max chain must be >= 0, got %d", p.MaxChain)
	case p.MaxContinued < 0:
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "max continued must be >= 0, got %d", p.MaxContinued)
	case p.MaxBytes < 0:
		return "", nil, outbox.Errorf(CodeInvalidArgument, op, "max bytes must be >= 0, got %d", p.MaxBytes)
	}
	n := len(p.Continue)
	keys, afters, ids := make([]string, n), make([]int64, n), make([]string, n)
	for i, c := range p.Continue {
		if c.Key == "" || c.AfterID == "" || c.AfterSeq <= 0 {
			return "", nil, outbox.Errorf(CodeInvalidArgument, op, "continuation %d needs a key, the seq and the id of the row it follows (got %q, %d, %q)", i, c.Key, c.AfterSeq, c.AfterID)
		}
		if slices.Contains(keys[:i], c.Key) {
			return "", nil, outbox.Errorf(CodeInvalidArgument, op, "key %q is continued twice", c.Key)
		}
		keys[i], afters[i], ids[i] = c.Key, c.AfterSeq, c.AfterID
	}
	// The chain bounds and the walk's size are integer parameters in SQL
	// (compared with a position, or with 0): a larger value (a huge Limit
	// standing in for them) means no bound, and must not reach the
	// database as a value integer cannot hold.
	maxChain, maxContinued := min(cmp.Or(p.MaxChain, p.Limit), math.MaxInt32), min(cmp.Or(p.MaxContinued, p.Limit), math.MaxInt32)
	unkeyed, walk := p.Limit, min(p.Limit, math.MaxInt32)
	if p.NoUnkeyed {
		unkeyed = 0
	}
	if p.NoKeyWalk {
		walk = 0
	}
	excluded := pq.Array(append([]string{}, p.ExcludeDestinations...))
	maxBytes := p.MaxBytes
	if p.StrictBytes {
		maxBytes = -maxBytes
	}
	if p.Lanes != nil || p.LaneCount != 0 {
		if err := checkLaneParams(op, p); err != nil {
			return "", nil, err
		}
		if p.NoKeyWalk && n == 0 && !p.NoUnkeyed {
			return laneUnkeyedClaimSQL(p.LaneCount), append([]any{nowArg(p.Now), p.Owner, p.Lease.Seconds(), p.MaxAttempts, p.Limit, p.FromSeq,
				excluded, p.OnlyDestination, maxBytes}, laneArgs(p)...), nil
		}
		return laneClaimSQL(p.Policy, p.LaneCount), append([]any{nowArg(p.Now), p.Owner, p.Lease.Seconds(), p.MaxAttempts, p.Limit, p.FromSeq,
			p.KeyCursor, maxChain, pq.Array(keys), pq.Array(afters), pq.Array(ids), unkeyed, walk,
			excluded, p.OnlyDestination, maxBytes, maxContinued}, laneArgs(p)...), nil
	}
	if p.NoKeyWalk && n == 0 && !p.NoUnkeyed {
		return claimUnkeyedSQL, []any{nowArg(p.Now), p.Owner, p.Lease.Seconds(), p.MaxAttempts, p.Limit, p.FromSeq,
			excluded, p.OnlyDestination, maxBytes}, nil
	}
	q := claimBlockKeySQL
	if p.Policy == SkipParked {
		q = claimSkipParkedSQL
	}
	return q, []any{nowArg(p.Now), p.Owner, p.Lease.Seconds(), p.MaxAttempts, p.Limit, p.FromSeq,
		p.KeyCursor, maxChain, pq.Array(keys), pq.Array(afters), pq.Array(ids), unkeyed, walk,
		excluded, p.OnlyDestination, maxBytes, maxContinued}, nil
}

// Claim takes up to p.Limit claimable rows for p.Owner in one statement and
// returns them in seq order (see the package documentation for what is
// claimable): unkeyed rows, and for ordering keys, chains (a key's head and
// the claimable rows right behind it, at most p.MaxChain). Rows come back
// IN_FLIGHT with a fresh lease, or EXHAUSTED when an expired lease spent the
// budget or the budget was already spent (a chain ends after such a row).
// Invalid parameters are refused with FENCING_INVALID_ARGUMENT before
// touching the database. p.Limit bounds the statement only (room for at
// most 1024 rows is allocated up front, the rest as rows arrive), so a huge
// Limit, up to math.MaxInt, claims what there is.
func Claim(ctx context.Context, db DBTX, p ClaimParams) ([]Claimed, error) {
	if p.Limit <= 0 { // refused by ClaimAppend; no buffer to size
		return ClaimAppend(ctx, db, nil, p)
	}
	return ClaimAppend(ctx, db, make([]Claimed, 0, min(p.Limit, claimPrealloc)), p)
}

// claimPrealloc caps the capacity Claim allocates up front from p.Limit.
const claimPrealloc = 1024

// ClaimAppend is [Claim] appending the claimed rows, in seq order, to dst
// and returning the extended slice (dst unchanged on an error), so a relay
// can keep one batch's memory for the next instead of allocating it per
// claim.
func ClaimAppend(ctx context.Context, db DBTX, dst []Claimed, p ClaimParams) ([]Claimed, error) {
	const op = "fencing.Claim"
	q, args, err := ClaimStatement(p)
	if err != nil {
		return dst, err
	}
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return dst, fmt.Errorf("%s: %w", op, err)
	}
	defer rows.Close()
	out := dst
	var rs envelope.RowScanner
	for rows.Next() {
		r, scanErr := rs.Scan(rows)
		if scanErr != nil && r.MessageID == "" {
			clear(out[len(dst):])
			return dst, fmt.Errorf("%s: scan: %w", op, scanErr)
		}
		c := Claimed{Row: r, Err: scanErr}
		if r.Status == envelope.StatusInFlight {
			c.Lease = Lease{MessageID: r.MessageID, Owner: r.LeaseOwner, Token: r.LeaseToken, ExpiresAt: r.LeaseExpiresAt}
			if p.Lanes != nil {
				c.Lease.Lanes, c.Lease.Attempts = p.LaneCount, r.Attempts
			}
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		clear(out[len(dst):])
		return dst, fmt.Errorf("%s: %w", op, err)
	}
	bySeq := func(a, b Claimed) int { return cmp.Compare(a.Row.Seq, b.Row.Seq) }
	if added := out[len(dst):]; !slices.IsSortedFunc(added, bySeq) { // RETURNING has no order; usually it is the CTE's
		slices.SortFunc(added, bySeq)
	}
	return out, nil
}

// releaseUnheldSQL releases every IN_FLIGHT row of owner $1 except the
// message ids $2, as [Release] does (PENDING when it never had an attempt,
// AMBIGUOUS otherwise, attempts not counted, lease ended).
const releaseUnheldSQL = `
UPDATE messaging_outbox o
   SET status = CASE WHEN o.attempts = 0 THEN 'PENDING' ELSE 'AMBIGUOUS' END,
       lease_expires_at = NULL
 WHERE o.status = 'IN_FLIGHT'
   AND o.lease_owner = $1
   AND o.message_id <> ALL($2::text[])
RETURNING o.message_id`

// ReleaseUnheld is the cleanup after a claim that failed on the caller's
// side once it was sent (a row it could not read, a timeout, a cancelled
// context, a connection lost while reading): the claim may have committed,
// and then its rows are IN_FLIGHT under owner, unknown to the caller, until
// their leases expire (each expiry spends an attempt). It releases every
// IN_FLIGHT row of owner whose message id is not in held (the rows the
// caller knows it holds), without spending attempts, and returns their ids.
// The caller must not run a claim for owner at the same time, and owner must
// be unique to it (as every lease owner must). No index serves "IN_FLIGHT
// rows of an owner", so the statement reads the claimable rows once: it runs
// only after such a failure.
func ReleaseUnheld(ctx context.Context, db DBTX, owner string, held []string) ([]string, error) {
	const op = "fencing.ReleaseUnheld"
	if owner == "" {
		return nil, outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	}
	rows, err := db.QueryContext(ctx, releaseUnheldSQL, owner, pq.Array(append([]string{}, held...)))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return ids, nil
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

// jsonObject writes a JSON object one member at a time.
type jsonObject struct{ buf []byte }

// key starts the next member, named k.
func (b *jsonObject) key(k string) {
	if len(b.buf) == 0 {
		b.buf = append(b.buf, '{')
	} else {
		b.buf = append(b.buf, ',')
	}
	b.buf = appendJSONString(b.buf, k)
	b.buf = append(b.buf, ':')
}

// close ends the object and returns it as the text of a jsonb argument.
func (b *jsonObject) close() string {
	if len(b.buf) == 0 {
		return "{}"
	}
	return string(append(b.buf, '}'))
}

// appendJSONString appends s as a JSON string. Text read from PostgreSQL
// is valid UTF-8 and is written as it is; invalid bytes (only possible in
// text that did not come from the table) are replaced the way encoding/json
// replaces them, so the statement still parses (such a row cannot match).
func appendJSONString(b []byte, s string) []byte {
	if !utf8.ValidString(s) {
		q, _ := json.Marshal(s)
		return append(b, q...)
	}
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
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
// result is cut to at most max bytes on a rune boundary. A max of 0 or less
// leaves no room: the result is "".
func CleanText(s string, max int) string {
	if max <= 0 {
		return ""
	}
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
