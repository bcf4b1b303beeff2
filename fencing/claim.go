// Claims: what a claim asks for (ClaimParams, continuations, the key
// cursor), the statement it runs and the rows it returns.

package fencing

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/lib/pq"
)

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
	// LaneCount is then the table's lane count ([LaneCount]), and HeldSeqs
	// the seqs of the rows Owner still holds from earlier claims (they are
	// not claimed again, and a continuation may follow one of them). Lease
	// is ignored: the lanes' leases bound the claim.
	Lanes     []int
	LaneCount int
	HeldSeqs  []int64
	// Held lists held rows by message id instead.
	//
	// Deprecated: use HeldSeqs. [Claim] and [ClaimAppend] look the ids'
	// seqs up first, in a query of their own (an id of no row is ignored);
	// [ClaimStatement] refuses them.
	Held []string
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
	// The short unkeyed statement takes the parameters the full one has
	// in common with it ($1-$6, then the three it renumbers); the lane
	// scheme appends its lanes and held ids to either.
	short := p.NoKeyWalk && n == 0 && !p.NoUnkeyed
	// A claim of any destination runs the statement without destination
	// filters (anyDestination).
	anyDest := len(p.ExcludeDestinations) == 0 && p.OnlyDestination == ""
	args := []any{nowArg(p.Now), p.Owner, p.Lease.Seconds(), p.MaxAttempts, p.Limit, p.FromSeq}
	if short {
		args = append(args, excluded, p.OnlyDestination, maxBytes)
	} else {
		args = append(args, p.KeyCursor, maxChain, pq.Array(keys), pq.Array(afters), pq.Array(ids), unkeyed, walk,
			excluded, p.OnlyDestination, maxBytes, maxContinued)
	}
	if p.Lanes != nil || p.LaneCount != 0 {
		if len(p.Held) > 0 {
			return "", nil, outbox.Errorf(CodeInvalidArgument, op, "a lane claim's statement takes held rows by seq (HeldSeqs), got %d message ids in Held", len(p.Held))
		}
		if err := checkLaneParams(op, p); err != nil {
			return "", nil, err
		}
		args = append(args, laneArgs(p)...)
		if short {
			return laneUnkeyedClaimSQL(p.LaneCount, anyDest), args, nil
		}
		return laneClaimSQL(p.Policy, p.LaneCount, anyDest), args, nil
	}
	switch {
	case short && anyDest:
		return claimUnkeyedAnySQL, args, nil
	case short:
		return claimUnkeyedSQL, args, nil
	case p.Policy == SkipParked && anyDest:
		return claimSkipParkedAnySQL, args, nil
	case p.Policy == SkipParked:
		return claimSkipParkedSQL, args, nil
	case anyDest:
		return claimBlockKeyAnySQL, args, nil
	}
	return claimBlockKeySQL, args, nil
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
	if len(p.Held) > 0 && (p.Lanes != nil || p.LaneCount != 0) {
		seqs, err := seqsOf(ctx, db, p.Held)
		if err != nil {
			return dst, fmt.Errorf("%s: %w", op, err)
		}
		p.HeldSeqs, p.Held = append(seqs, p.HeldSeqs...), nil
	}
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
		if r.Status == envelope.StatusInFlight && (p.Lanes != nil || p.LaneCount != 0) {
			r.LeaseOwner = p.Owner // the lanes' owner: not sent back with every row
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
