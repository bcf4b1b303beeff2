package fencing_test

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

var t0 = time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)

func insert(t *testing.T, db *sql.DB, id, key string) {
	t.Helper()
	testdb.InsertRow(t, db, envelope.Row{MessageID: id, Destination: "orders", Payload: []byte("p-" + id), OrderingKey: key})
}

func newDB(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	return s
}

func params(owner string, now time.Time) fencing.ClaimParams {
	return fencing.ClaimParams{Owner: owner, Limit: 100, Lease: 30 * time.Second, MaxAttempts: 3, Now: now}
}

func ids(cs []fencing.Claimed) []string {
	out := make([]string, 0, len(cs))
	for _, c := range cs {
		out = append(out, c.Row.MessageID)
	}
	return out
}

type rowState struct {
	Status, Owner, Code string
	Attempts            int
	Token               int64
	Parked, Published   bool
	Next                sql.NullTime
}

func state(t *testing.T, db *sql.DB, id string) rowState {
	t.Helper()
	var s rowState
	var owner, code sql.NullString
	var parked, published sql.NullTime
	err := db.QueryRow(`SELECT status, lease_owner, last_failure_code, attempts, lease_token, parked_at, published_at, next_attempt_at
		FROM messaging_outbox WHERE message_id = $1`, id).
		Scan(&s.Status, &owner, &code, &s.Attempts, &s.Token, &parked, &published, &s.Next)
	require.NoError(t, err)
	s.Owner, s.Code, s.Parked, s.Published = owner.String, code.String, parked.Valid, published.Valid
	return s
}

func TestTwoRelaysClaimDisjointRowsWithTheirOwnTokens(t *testing.T) {
	s := newDB(t)
	const total = 300
	for i := range total {
		insert(t, s.DB, fmt.Sprintf("m%03d", i), "")
	}
	dbA, dbB := s.Open(t), s.Open(t)
	dbA.SetMaxOpenConns(2)
	dbB.SetMaxOpenConns(2)

	var mu sync.Mutex
	got := map[string]fencing.Lease{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for _, r := range []struct {
		owner string
		db    *sql.DB
	}{{"relay-a", dbA}, {"relay-b", dbB}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for {
				p := params(r.owner, time.Time{})
				p.Limit = 7
				cs, err := fencing.Claim(context.Background(), r.db, p)
				if err != nil {
					t.Errorf("claim: %v", err)
					return
				}
				if len(cs) == 0 {
					return
				}
				mu.Lock()
				for _, c := range cs {
					if prev, dup := got[c.Row.MessageID]; dup {
						t.Errorf("row %s claimed twice: %+v and %+v", c.Row.MessageID, prev, c.Lease)
					}
					got[c.Row.MessageID] = c.Lease
				}
				mu.Unlock()
			}
		}()
	}
	close(start)
	wg.Wait()
	require.Len(t, got, total)
	owners := map[string]int{}
	for id, l := range got {
		require.Equal(t, id, l.MessageID)
		require.Equal(t, int64(1), l.Token, "first claim of a row issues token 1")
		owners[l.Owner]++
	}
	// Both relays made progress on the same table at the same time.
	require.Len(t, owners, 2, "both relays should have claimed rows: %v", owners)
	require.Equal(t, total, s.Count(t, "status = 'IN_FLIGHT'"))
}

func TestSupersededRelayCannotOverwrite(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "m1", "")

	a, err := fencing.Claim(ctx, s.DB, params("relay-a", t0))
	require.NoError(t, err)
	require.Len(t, a, 1)
	require.Equal(t, t0.Add(30*time.Second), a[0].Lease.ExpiresAt.UTC())
	// Claimed.Row's documented zero: the claim set last_attempt_at in the
	// table but does not return it.
	require.True(t, a[0].Row.LastAttemptAt.IsZero())
	var lastAttempt time.Time
	require.NoError(t, s.DB.QueryRow(`SELECT last_attempt_at FROM messaging_outbox WHERE message_id = 'm1'`).Scan(&lastAttempt))
	require.True(t, lastAttempt.Equal(t0), "last_attempt_at %s", lastAttempt)

	// Before expiry nobody else can take it.
	none, err := fencing.Claim(ctx, s.DB, params("relay-b", t0.Add(29*time.Second)))
	require.NoError(t, err)
	require.Empty(t, none)

	// At expiry relay B reclaims: same message id, next token, the lost
	// attempt counted and explained.
	b, err := fencing.Claim(ctx, s.DB, params("relay-b", t0.Add(30*time.Second)))
	require.NoError(t, err)
	require.Len(t, b, 1)
	require.True(t, b[0].Held())
	require.Equal(t, "m1", b[0].Lease.MessageID)
	require.Equal(t, a[0].Lease.Token+1, b[0].Lease.Token)
	require.Equal(t, 1, b[0].Row.Attempts)
	require.Equal(t, fencing.CodeLeaseExpired, b[0].Row.LastFailureCode)
	require.Contains(t, b[0].Row.LastFailureDetail, "relay-a")

	res, err := fencing.MarkPublished(ctx, s.DB, b[0].Lease, t0.Add(31*time.Second))
	require.NoError(t, err)
	require.Equal(t, fencing.Applied, res)

	// Relay A wakes up: every write it tries is stale and changes nothing.
	for _, o := range []fencing.Outcome{
		{Lease: a[0].Lease, To: envelope.StatusPublished},
		{Lease: a[0].Lease, To: envelope.StatusAmbiguous},
		{Lease: a[0].Lease, To: envelope.StatusFailed, Code: "X"},
		{Lease: a[0].Lease, To: envelope.StatusExhausted, Code: "X"},
		{Lease: a[0].Lease, To: envelope.StatusPending},
	} {
		res, err := fencing.Apply(ctx, s.DB, []fencing.Outcome{o})
		require.NoError(t, err)
		require.Equal(t, []fencing.Result{fencing.Stale}, res, "write to %s", o.To)
	}
	st := state(t, s.DB, "m1")
	require.Equal(t, "PUBLISHED", st.Status)
	require.Equal(t, 2, st.Attempts)
	require.Equal(t, "relay-b", st.Owner)
	require.True(t, st.Published)
}

func TestAmbiguousRowWaitsForNextAttempt(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "m1", "")
	c, err := fencing.Claim(ctx, s.DB, params("r", t0))
	require.NoError(t, err)
	require.Len(t, c, 1)
	res, err := fencing.MarkAmbiguous(ctx, s.DB, c[0].Lease, t0.Add(10*time.Second), "PUBLISH_TIMEOUT", "no answer", t0.Add(time.Second))
	require.NoError(t, err)
	require.Equal(t, fencing.Applied, res)
	st := state(t, s.DB, "m1")
	require.Equal(t, "AMBIGUOUS", st.Status)
	require.Equal(t, "PUBLISH_TIMEOUT", st.Code)
	require.Equal(t, 1, st.Attempts)
	require.Equal(t, t0.Add(10*time.Second), st.Next.Time.UTC())

	early, err := fencing.Claim(ctx, s.DB, params("r", t0.Add(9*time.Second)))
	require.NoError(t, err)
	require.Empty(t, early)
	due, err := fencing.Claim(ctx, s.DB, params("r", t0.Add(10*time.Second)))
	require.NoError(t, err)
	require.Equal(t, []string{"m1"}, ids(due))
	require.Equal(t, int64(2), due[0].Lease.Token)
}

func TestRowOutOfAttemptsIsParkedNotHeld(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "m1", "")
	p := params("r", t0)
	p.MaxAttempts = 2
	for i := range 2 {
		c, err := fencing.Claim(ctx, s.DB, p)
		require.NoError(t, err)
		require.Len(t, c, 1, "attempt %d", i+1)
		_, err = fencing.MarkAmbiguous(ctx, s.DB, c[0].Lease, time.Time{}, "X", "", t0)
		require.NoError(t, err)
	}
	// A row with attempts >= max is never held again: the claim parks it.
	c, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Len(t, c, 1)
	require.False(t, c[0].Held())
	require.Equal(t, fencing.CodeBudgetSpent, state(t, s.DB, "m1").Code)
}

// A budget lowered below the attempts a row already spent (AMBIGUOUS at 7,
// MaxAttempts now 5) must not leave the row waiting forever, silently
// blocking its key: the claim parks it EXHAUSTED, in order, and reports it.
func TestRowOverALoweredBudgetIsParkedByTheClaim(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "k1", "key")
	insert(t, s.DB, "k2", "key")
	insert(t, s.DB, "early", "other")
	insert(t, s.DB, "late", "other") // over budget, but not its key's head
	insert(t, s.DB, "lone", "")
	// Spent attempts; k1 even waits for a retry a day from now.
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = 'AMBIGUOUS', attempts = 7, last_failure_code = 'PUBLISH_TIMEOUT',
		last_failure_detail = 'no answer', next_attempt_at = $1 WHERE message_id = 'k1'`, t0.Add(24*time.Hour))
	require.NoError(t, err)
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'AMBIGUOUS', attempts = 6 WHERE message_id IN ('late', 'lone')`)
	require.NoError(t, err)
	p := params("r", t0)
	p.MaxAttempts = 5
	c, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"k1", "early", "late", "lone"}, ids(c), "k2 waits behind the parked k1; late, over budget, is parked in early's chain, which ends there")
	for _, x := range c {
		switch x.Row.MessageID {
		case "early":
			require.True(t, x.Held())
		default:
			require.False(t, x.Held(), x.Row.MessageID)
			require.Equal(t, fencing.Lease{}, x.Lease)
			require.Equal(t, envelope.StatusExhausted, x.Row.Status)
			st := state(t, s.DB, x.Row.MessageID)
			require.Equal(t, fencing.CodeBudgetSpent, st.Code)
			require.True(t, st.Parked)
		}
	}
	st := state(t, s.DB, "k1")
	require.Equal(t, 7, st.Attempts, "parking spends no attempt")
	var detail string
	require.NoError(t, s.DB.QueryRow(`SELECT last_failure_detail FROM messaging_outbox WHERE message_id = 'k1'`).Scan(&detail))
	require.Equal(t, "7 attempts already reach the budget of 5; last failure: PUBLISH_TIMEOUT: no answer", detail)

	// Under BlockKey the parked head now visibly blocks k2; SkipParked
	// lets it through.
	p.Now = t0.Add(10 * time.Second) // early's lease (30 s) still holds
	c, err = fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Empty(t, c)
	p.Policy = fencing.SkipParked
	c, err = fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"k2"}, ids(c))
	require.True(t, c[0].Held())
}

func TestExpiredLeaseThatSpendsTheBudgetIsParked(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "m1", "")
	p := params("r1", t0)
	p.MaxAttempts = 1
	c, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Len(t, c, 1)

	// The relay died mid-publish. The reclaim counts that attempt, which was
	// the last one: the same statement parks the row and reports it.
	p.Owner, p.Now = "r2", t0.Add(time.Minute)
	c2, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Len(t, c2, 1)
	require.False(t, c2[0].Held())
	require.Equal(t, envelope.StatusExhausted, c2[0].Row.Status)
	require.Equal(t, fencing.Lease{}, c2[0].Lease)
	st := state(t, s.DB, "m1")
	require.Equal(t, "EXHAUSTED", st.Status)
	require.Equal(t, fencing.CodeLeaseExpired, st.Code)
	require.Equal(t, 1, st.Attempts)
	require.True(t, st.Parked)
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"))

	// The old holder is fenced off.
	res, err := fencing.MarkPublished(ctx, s.DB, c[0].Lease, time.Time{})
	require.NoError(t, err)
	require.Equal(t, fencing.Stale, res)
}

func TestExhaustedAndFailedAreDistinct(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "ex", "")
	insert(t, s.DB, "fa", "")
	c, err := fencing.Claim(ctx, s.DB, params("r", t0))
	require.NoError(t, err)
	require.Len(t, c, 2)
	res, err := fencing.Apply(ctx, s.DB, []fencing.Outcome{
		{Lease: c[0].Lease, To: envelope.StatusExhausted, Code: "PUBLISH_TIMEOUT", Detail: "budget spent", Now: t0},
		{Lease: c[1].Lease, To: envelope.StatusFailed, Code: "INVALID_ARGUMENT", Detail: "broker refused"},
	})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied, fencing.Applied}, res)
	ex, fa := state(t, s.DB, "ex"), state(t, s.DB, "fa")
	require.Equal(t, "EXHAUSTED", ex.Status)
	require.Equal(t, "PUBLISH_TIMEOUT", ex.Code)
	require.Equal(t, "FAILED", fa.Status)
	require.Equal(t, "INVALID_ARGUMENT", fa.Code)
	require.True(t, ex.Parked)
	require.True(t, fa.Parked)
	require.Equal(t, 1, ex.Attempts)
	require.Equal(t, 1, fa.Attempts)
	later, err := fencing.Claim(ctx, s.DB, params("r", t0.Add(time.Hour)))
	require.NoError(t, err)
	require.Empty(t, later, "parked rows are never claimed")
}

func TestApplyBatchMixesAppliedAndStale(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for i := range 5 {
		insert(t, s.DB, fmt.Sprintf("m%d", i), "")
	}
	c, err := fencing.Claim(ctx, s.DB, params("r", t0))
	require.NoError(t, err)
	require.Len(t, c, 5)
	forged := c[3].Lease
	forged.Token++
	wrongOwner := c[4].Lease
	wrongOwner.Owner = "someone-else"
	res, err := fencing.Apply(ctx, s.DB, []fencing.Outcome{
		{Lease: c[0].Lease, To: envelope.StatusPublished},
		{Lease: c[1].Lease, To: envelope.StatusAmbiguous, Code: "X", Detail: strings.Repeat("é", 2000)},
		{Lease: c[2].Lease, To: envelope.StatusPending},
		{Lease: forged, To: envelope.StatusPublished},
		{Lease: wrongOwner, To: envelope.StatusPublished},
	})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied, fencing.Applied, fencing.Applied, fencing.Stale, fencing.Stale}, res)
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m0").Status)
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "m1").Status)
	var detail string
	require.NoError(t, s.DB.QueryRow(`SELECT last_failure_detail FROM messaging_outbox WHERE message_id = 'm1'`).Scan(&detail))
	require.LessOrEqual(t, len(detail), fencing.MaxFailureDetail)
	require.True(t, strings.HasPrefix(detail, "é"))
	rel := state(t, s.DB, "m2")
	require.Equal(t, "PENDING", rel.Status, "a released row that never had an attempt is PENDING again")
	require.Equal(t, 0, rel.Attempts)
	require.Equal(t, "IN_FLIGHT", state(t, s.DB, "m3").Status)
	require.Equal(t, "IN_FLIGHT", state(t, s.DB, "m4").Status)
}

func TestReleaseKeepsAmbiguityAndAttempts(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "m1", "")
	c, err := fencing.Claim(ctx, s.DB, params("r", t0))
	require.NoError(t, err)
	_, err = fencing.MarkAmbiguous(ctx, s.DB, c[0].Lease, time.Time{}, "X", "", t0)
	require.NoError(t, err)
	c, err = fencing.Claim(ctx, s.DB, params("r", t0))
	require.NoError(t, err)
	require.Len(t, c, 1)
	res, err := fencing.Release(ctx, s.DB, c[0].Lease, t0)
	require.NoError(t, err)
	require.Equal(t, fencing.Applied, res)
	st := state(t, s.DB, "m1")
	require.Equal(t, "AMBIGUOUS", st.Status)
	require.Equal(t, 1, st.Attempts)
}

func TestOrderingKeyChainStartsAtTheHead(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "a1", "K")
	insert(t, s.DB, "b1", "")
	insert(t, s.DB, "a2", "K")
	insert(t, s.DB, "a3", "K")
	insert(t, s.DB, "c1", "L")

	heads1 := func(now time.Time) fencing.ClaimParams {
		p := params("r", now)
		p.MaxChain = 1
		return p
	}
	c, err := fencing.Claim(ctx, s.DB, heads1(t0))
	require.NoError(t, err)
	require.Equal(t, []string{"a1", "b1", "c1"}, ids(c), "chains of one: the head of each key")
	res, err := fencing.Apply(ctx, s.DB, []fencing.Outcome{{Lease: c[1].Lease, To: envelope.StatusPublished}, {Lease: c[2].Lease, To: envelope.StatusPublished}})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied, fencing.Applied}, res)

	// While a1 is in flight, or ambiguous, a2 waits.
	_, err = fencing.MarkAmbiguous(ctx, s.DB, c[0].Lease, t0.Add(time.Minute), "X", "", t0)
	require.NoError(t, err)
	c2, err := fencing.Claim(ctx, s.DB, heads1(t0.Add(time.Second)))
	require.NoError(t, err)
	require.Empty(t, c2)

	c3, err := fencing.Claim(ctx, s.DB, heads1(t0.Add(time.Minute)))
	require.NoError(t, err)
	require.Equal(t, []string{"a1"}, ids(c3))
	_, err = fencing.MarkPublished(ctx, s.DB, c3[0].Lease, time.Time{})
	require.NoError(t, err)

	c4, err := fencing.Claim(ctx, s.DB, heads1(t0.Add(time.Minute)))
	require.NoError(t, err)
	require.Equal(t, []string{"a2"}, ids(c4))
	_, err = fencing.MarkFailed(ctx, s.DB, c4[0].Lease, "REJECTED", "", time.Time{})
	require.NoError(t, err)

	// BlockKey: the parked a2 holds a3 back.
	block, err := fencing.Claim(ctx, s.DB, heads1(t0.Add(time.Hour)))
	require.NoError(t, err)
	require.Empty(t, block)

	// SkipParked: a3 goes past it.
	p := heads1(t0.Add(time.Hour))
	p.Policy = fencing.SkipParked
	skip, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"a3"}, ids(skip))
}

func TestCorruptRowIsHeldAndReported(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ('bad', 'd', '', '{"n": 1}')`)
	require.NoError(t, err)
	c, err := fencing.Claim(ctx, s.DB, params("r", t0))
	require.NoError(t, err)
	require.Len(t, c, 1)
	require.True(t, c[0].Held())
	require.ErrorIs(t, c[0].Err, outbox.ErrCorruptRow)
	res, err := fencing.MarkFailed(ctx, s.DB, c[0].Lease, string(outbox.CodeCorruptRow), c[0].Err.Error(), time.Time{})
	require.NoError(t, err)
	require.Equal(t, fencing.Applied, res)
	require.Equal(t, "FAILED", state(t, s.DB, "bad").Status)
}

func TestClaimPlanUsesTheClaimableIndex(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, status, ordering_key, published_at)
		SELECT 'm' || g, 'd', '', CASE WHEN g % 50 = 0 THEN 'PENDING' ELSE 'PUBLISHED' END,
		       CASE WHEN g % 3 = 0 THEN 'k' || (g % 17) END, CASE WHEN g % 50 <> 0 THEN now() END
		  FROM generate_series(1, 20000) g`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
	require.NoError(t, err)
	for name, q := range map[string]string{"block": fencing.ClaimBlockKeySQL, "skip": fencing.ClaimSkipParkedSQL} {
		rows, err := s.DB.Query("EXPLAIN "+q, t0, "r", 30.0, 10, 100, 5000, "", 100, "{}", "{}", "{}", 100, 100, "{}", "", 0, 100)
		require.NoError(t, err)
		var plan []string
		for rows.Next() {
			var line string
			require.NoError(t, rows.Scan(&line))
			plan = append(plan, line)
		}
		require.NoError(t, rows.Err())
		text := strings.Join(plan, "\n")
		require.Contains(t, text, "messaging_outbox_ordering_head_idx", "%s plan:\n%s", name, text)
		// The unkeyed half walks the unkeyed claimable index in seq order;
		// the keyed half reads keys, heads and chains from the ordering
		// index (no scan of the claimable set, no bitmap over the backlog).
		require.Regexp(t, `Index Scan using messaging_outbox_unkeyed_claimable_idx on messaging_outbox o_\d`, text, "%s plan:\n%s", name, text)
		require.NotContains(t, text, "Seq Scan", "%s plan:\n%s", name, text)
		require.NotContains(t, text, "messaging_outbox_claimable_idx", "%s plan:\n%s", name, text)
		require.NotContains(t, text, "Bitmap", "%s plan:\n%s", name, text)
		// FromSeq is where the index scan starts, not a filter over it.
		require.Regexp(t, `Index Cond: \(seq >= \$6\)|Index Cond: \(seq >= '?5000`, text, "%s plan:\n%s", name, text)
	}
}

// FromSeq: a claim takes no row below it, and only rows below it are left;
// 0 takes from the first row.
func TestClaimFromSeqStartsThere(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for _, id := range []string{"m1", "m2", "m3", "m4", "m5"} {
		insert(t, s.DB, id, "")
	}
	var seq3 int64
	require.NoError(t, s.DB.QueryRow(`SELECT seq FROM messaging_outbox WHERE message_id = 'm3'`).Scan(&seq3))
	p := params("relay-a", t0)
	p.FromSeq = seq3
	cl, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"m3", "m4", "m5"}, ids(cl))
	p.FromSeq = 0
	cl, err = fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"m1", "m2"}, ids(cl), "the rows below FromSeq were left claimable")
}

func TestInvalidArgumentsAreRefused(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	good := params("r", t0)
	for name, mut := range map[string]func(*fencing.ClaimParams){
		"owner":                      func(p *fencing.ClaimParams) { p.Owner = "" },
		"limit":                      func(p *fencing.ClaimParams) { p.Limit = 0 },
		"lease":                      func(p *fencing.ClaimParams) { p.Lease = 0 },
		"attempts":                   func(p *fencing.ClaimParams) { p.MaxAttempts = 0 },
		"attempts beyond the column": func(p *fencing.ClaimParams) { p.MaxAttempts = math.MaxInt32 + 1 },
		"policy":                     func(p *fencing.ClaimParams) { p.Policy = 7 },
		"from":                       func(p *fencing.ClaimParams) { p.FromSeq = -1 },
	} {
		p := good
		mut(&p)
		_, err := fencing.Claim(ctx, s.DB, p)
		require.ErrorIs(t, err, fencing.ErrInvalidArgument, name)
	}
	l := fencing.Lease{MessageID: "m", Owner: "r", Token: 1}
	for name, o := range map[string][]fencing.Outcome{
		"in-flight target": {{Lease: l, To: envelope.StatusInFlight}},
		"unknown target":   {{Lease: l, To: "DONE"}},
		"failed no code":   {{Lease: l, To: envelope.StatusFailed}},
		"exhaust no code":  {{Lease: l, To: envelope.StatusExhausted}},
		"zero token":       {{Lease: fencing.Lease{MessageID: "m", Owner: "r"}, To: envelope.StatusPublished}},
		"no owner":         {{Lease: fencing.Lease{MessageID: "m", Token: 1}, To: envelope.StatusPublished}},
		"duplicate":        {{Lease: l, To: envelope.StatusPublished}, {Lease: l, To: envelope.StatusPublished}},
	} {
		_, err := fencing.Apply(ctx, s.DB, o)
		require.ErrorIs(t, err, fencing.ErrInvalidArgument, name)
	}
	res, err := fencing.Apply(ctx, s.DB, nil)
	require.NoError(t, err)
	require.Empty(t, res)
}

func TestCleanText(t *testing.T) {
	require.Equal(t, "a\uFFFDb", fencing.CleanText("a\x00b", 10))
	require.Equal(t, "a\uFFFD", fencing.CleanText("a\xff", 10))
	require.Equal(t, "é", fencing.CleanText("éé", 3), "never cuts inside a rune")
	require.Equal(t, "abc", fencing.CleanText("abc", 3))
}

func TestPolicyAndResultNames(t *testing.T) {
	require.Equal(t, "block-key", fencing.BlockKey.String())
	require.Equal(t, "skip-parked", fencing.SkipParked.String())
	require.Equal(t, "OrderingPolicy(9)", fencing.OrderingPolicy(9).String())
	require.Equal(t, "applied", fencing.Applied.String())
	require.Equal(t, "stale", fencing.Stale.String())
	require.Equal(t, "Result(0)", fencing.Result(0).String())
}

// hotUpdates is the number of this transaction's updates of messaging_outbox
// that PostgreSQL made as HOT updates (no new index entries, new row version
// on the same page). The counter is per transaction, so concurrent tests do
// not disturb it.
func hotUpdates(t *testing.T, tx *sql.Tx) (hot, all int) {
	t.Helper()
	require.NoError(t, tx.QueryRow(`SELECT pg_stat_get_xact_tuples_hot_updated('messaging_outbox'::regclass),
	       pg_stat_get_xact_tuples_updated('messaging_outbox'::regclass)`).Scan(&hot, &all))
	return hot, all
}

// No index reads a column the claim writes (migration 00030), so the claim,
// a retry (AMBIGUOUS) and a release are HOT updates; only leaving the
// claimable set (PUBLISHED, parked) adds index entries. This is what halves
// the WAL a relayed row costs; see BENCHMARKS.md.
func TestClaimRetryAndReleaseAreHOTUpdates(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for i := range 20 {
		key := ""
		if i%2 == 0 {
			key = fmt.Sprintf("k%d", i%4)
		}
		insert(t, s.DB, fmt.Sprintf("m%02d", i), key)
	}
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()

	c, err := fencing.Claim(ctx, tx, params("relay-a", t0))
	require.NoError(t, err)
	require.Len(t, c, 20, "10 unkeyed rows and the chains of the 2 keys, 5 rows each")
	hot, all := hotUpdates(t, tx)
	require.Equal(t, 20, all)
	require.Equal(t, 20, hot, "every claim update is HOT")

	var outcomes []fencing.Outcome
	for i, cl := range c {
		switch i % 3 {
		case 0:
			outcomes = append(outcomes, fencing.Outcome{Lease: cl.Lease, To: envelope.StatusAmbiguous, Code: "PUBLISH_TIMEOUT", Detail: "t", Now: t0})
		case 1:
			outcomes = append(outcomes, fencing.Outcome{Lease: cl.Lease, To: envelope.StatusPending, Now: t0})
		default:
			outcomes = append(outcomes, fencing.Outcome{Lease: cl.Lease, To: envelope.StatusPublished, Now: t0})
		}
	}
	res, err := fencing.Apply(ctx, tx, outcomes)
	require.NoError(t, err)
	for _, r := range res {
		require.Equal(t, fencing.Applied, r)
	}
	hot, all = hotUpdates(t, tx)
	require.Equal(t, 40, all)
	require.Equal(t, 20+14, hot, "AMBIGUOUS and released rows stay HOT; the 6 PUBLISHED rows leave the claimable indexes")
}

// The fillfactor claims of migrations 00030 and 00031, fencing/doc.go,
// README.md and BENCHMARKS.md: with 1 KB payloads a claim of a fresh table's
// rows is HOT for every row at fillfactor 50 (the default), for roughly 40%
// of them at 70 (between 30% and 50%), and for none at 100 (no room on the
// page for the new version).
func TestClaimHOTShareFollowsFillfactor(t *testing.T) {
	ctx := context.Background()
	payload := strings.Repeat("x", 1024)
	for _, c := range []struct {
		fillfactor int
		hot        func(hot, all int) bool
		want       string
	}{
		{50, func(hot, all int) bool { return hot == all }, "all"},
		{70, func(hot, all int) bool { return 10*hot >= 3*all && 2*hot <= all }, "30% to 50%"},
		{100, func(hot, all int) bool { return hot == 0 }, "none"},
	} {
		t.Run(fmt.Sprint(c.fillfactor), func(t *testing.T) {
			s := newDB(t)
			if c.fillfactor != 50 {
				_, err := s.DB.Exec(fmt.Sprintf(`ALTER TABLE messaging_outbox SET (fillfactor = %d)`, c.fillfactor))
				require.NoError(t, err)
			}
			_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
SELECT 'm' || g, 'orders', convert_to($1, 'UTF8') FROM generate_series(1, 24) g`, payload)
			require.NoError(t, err)
			tx, err := s.DB.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			cl, err := fencing.Claim(ctx, tx, params("relay-a", t0))
			require.NoError(t, err)
			require.Len(t, cl, 24)
			hot, all := hotUpdates(t, tx)
			require.Equal(t, 24, all)
			require.True(t, c.hot(hot, all), "fillfactor %d: %d of %d claims HOT, want %s", c.fillfactor, hot, all, c.want)
		})
	}
}
