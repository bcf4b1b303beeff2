// The claim statement's SQL, built once per policy and scheme.

package fencing

import (
	"regexp"
	"strings"
)

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
	runs, unkeyed := unkeyedHalf(lanes)
	finish := claimUpdate("picked")
	// locked is the candidates as they are now; ranked joins each to its
	// position in its chain (pos). The per-row scheme locks them through
	// their ctids, then joins them back to the candidates (the lock makes
	// locked a materialized CTE, the join a hash join). The lane scheme
	// locks nothing and reads each candidate's row by its ctid, one TID
	// lookup per candidate: joined afterwards, the unlocked read was
	// planned as a nested loop over the candidates for every row (770 ms
	// for 1,500); as a plain join of the candidates with the table, the
	// planner could drive it from the table, and on a table not analyzed
	// since it filled read every claimable row through
	// messaging_outbox_claimable_idx (TestLaneWalkClaimReadsOnlyItsCandidates).
	// The LIMIT keeps the subquery from being pulled up into such a join.
	locked := `
    SELECT o.ctid AS picked_ctid, o.seq, o.ordering_key AS k, ` + rowBytes + ` AS bytes,
           o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park,
           ` + claimableIn("o", lanes) + ` AS ok
      FROM messaging_outbox o
     WHERE o.ctid = ANY (ARRAY(SELECT row_ctid FROM candidates))` + lockRows
	ranked := `SELECT l.*, c.pos FROM locked l JOIN candidates c ON c.seq = l.seq`
	if lanes > 0 {
		heldAfter = `p.seq IN (SELECT unnest($19::int8[]))`
		finish = laneClaimFinish("picked", lanes)
		locked = `
    SELECT r.*, c.pos FROM candidates c CROSS JOIN LATERAL (
        SELECT o.ctid AS picked_ctid, o.seq, o.ordering_key AS k, ` + rowBytes + ` AS bytes,
               o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park,
               ` + claimableIn("o", lanes) + ` AS ok
          FROM messaging_outbox o
         WHERE o.ctid = c.row_ctid
         LIMIT 1) r`
		ranked = `SELECT l.* FROM locked l`
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
locked AS (` + locked + `
),` + runs + `
unkeyed AS (` + unkeyed + `
),
picked AS (
    SELECT u.picked_ctid, u.seq, u.bytes, u.expired, u.park FROM (
        SELECT picked_ctid, seq, bytes, expired, park FROM unkeyed
        UNION ALL
        SELECT picked_ctid, seq, bytes, expired, park
          FROM (SELECT l.*, row_number() OVER (PARTITION BY l.k ORDER BY l.seq) AS rank
                  FROM (` + ranked + `) l
                 WHERE l.ok) r
         WHERE r.rank = r.pos
    ) u
    ORDER BY u.seq
    LIMIT $5
)
` + finish
}

// unkeyedHalf is the claim's unkeyed rows ($12 at most, from seq $6), and
// the CTEs they read (ctes, to precede the unkeyed CTE; none in the per-row
// scheme): one index range scan with SKIP LOCKED in the per-row scheme; in
// the lane scheme the rows of the runs that unkeyed_runs walks (unkeyedRunsCTE: a
// descent of messaging_outbox_lane_idx per run, from greatest($6, the
// lane's floor), floor.go), a run of each lane of $18 at a time, stopping
// once $12 rows are found (the lanes are not merged in seq order: unkeyed
// rows have no order to keep, and a merge would read every lane's rows to
// return the first $12). Read as one ordered scan per lane, cut at $12,
// the lane was read through a bitmap of every entry above its floor and
// sorted: a bitmap scan never marks the dead index entries it meets, so
// every claim fetched the heap of every row published there since the
// floor last rose (a 100-row claim on 32 lanes after 40,000 rows: 1,051
// buffers, 966 heap pages).
func unkeyedHalf(lanes int) (ctes, rows string) {
	if lanes == 0 {
		return "", `
    SELECT o.ctid AS picked_ctid, o.seq, ` + rowBytes + ` AS bytes, o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park
      FROM messaging_outbox o
     WHERE o.ordering_key IS NULL AND ` + claimable("o") + ` AND o.seq >= $6
     ORDER BY o.seq
     LIMIT $12
       FOR UPDATE OF o SKIP LOCKED`
	}
	return unkeyedRunsCTE(lanes), `
    SELECT u.* FROM unkeyed_runs r CROSS JOIN LATERAL (
        SELECT o.ctid AS picked_ctid, o.seq, ` + rowBytes + ` AS bytes, o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park
          FROM messaging_outbox o
         WHERE ` + runRows("r.s") + `) u
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
// destination, $9 byte budget). It exists because the full claim costs more
// to plan and to run: a relay whose backlog has no keyed rows runs this
// one, and walks the keys only now and then.
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

// hiddenLimit is a LIMIT of parameter p that the planner cannot see: read
// through a sub-select, which it never folds into a constant (it assumes a
// tenth of the rows for every plan, custom or generic).
func hiddenLimit(p string) string { return "LIMIT (SELECT " + p + "::int8)" }

// paramLimit matches a LIMIT taken from a parameter; destFilter matches
// claimable's destination filter in a generated claim statement, on any
// alias and with its two parameters however renumbered.
var (
	paramLimit = regexp.MustCompile(`LIMIT (\$\d+)\b`)
	destFilter = regexp.MustCompile(`\s*AND (\w+)\.destination <> ALL\((\$\d+)::text\[\]\) AND \((\$\d+)::text = '' OR \w+\.destination = \$\d+::text\)`)
)

// anyDestination is the claim statement q for a claim that excludes no
// destination and requires none (no breaker open, no probe: nearly every
// claim): its destination filters removed, their two parameters still
// typed (by a CTE nothing reads, so that the statement takes the same
// arguments), and its limits read through sub-selects, which the planner
// never folds into constants.
//
// Why: PostgreSQL plans a prepared statement afresh at each execution while
// the custom plans it makes for the arguments look cheaper than the generic
// plan. With the filters in its text, a per-row claim's generic plan
// estimated that they keep only some rows, so that its limits are reached
// further down the index; given the limit, its custom plans looked cheaper
// still. So on a backlog without keys every per-row claim was planned again
// (0 generic plans in 50 claims; 46-48 µs of the server's CPU a claimed row
// at claims of 30 rows, against 32-35 on the generic plan; BENCHMARKS.md,
// session 8). With the limits and the filters both hidden behind
// sub-selects (tried before), the custom plans read the table whole on a
// large backlog; with the filters removed instead, they read the index
// (TestCustomPlansOfTheClaimsReadNoTableWhole,
// TestEveryClaimReadsNearItsLimit), and every claim statement switches to
// its generic plan (TestClaimsSwitchToTheirGenericPlans). A claim that
// filters destinations runs q as it is.
func anyDestination(q string) string {
	m := destFilter.FindStringSubmatch(q)
	body := strings.TrimLeft(q, "\n ")
	head := "WITH RECURSIVE "
	if !strings.HasPrefix(body, head) {
		head = "WITH "
	}
	if m == nil || !strings.HasPrefix(body, head) {
		panic("fencing: a claim statement without its destination filter, or not a WITH statement")
	}
	typed := head + "destinations AS (SELECT " + m[2] + "::text[] AS excluded, " + m[3] + "::text AS required),\n"
	out := destFilter.ReplaceAllString(body[len(head):], "")
	out = paramLimit.ReplaceAllStringFunc(out, func(l string) string { return hiddenLimit(strings.TrimPrefix(l, "LIMIT ")) })
	return "\n" + typed + out
}

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
	// The same three for a claim of any destination (anyDestination).
	claimBlockKeyAnySQL   = anyDestination(claimBlockKeySQL)
	claimSkipParkedAnySQL = anyDestination(claimSkipParkedSQL)
	claimUnkeyedAnySQL    = anyDestination(claimUnkeyedSQL)
)
