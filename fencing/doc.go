// Package fencing moves outbox rows between states under a lease, and is the
// only code that does.
//
// A relay takes rows with [Claim]: one statement, run by the server, that picks
// claimable rows in seq order with FOR UPDATE SKIP LOCKED, marks them
// IN_FLIGHT for the caller (owner) until now + lease, and increments each row's
// lease_token. The owner and the token together are the [Lease]; every
// transition out of IN_FLIGHT ([MarkPublished], [MarkAmbiguous],
// [MarkExhausted], [MarkFailed], [Release] and the batch form [Apply]) matches
// message_id AND status = 'IN_FLIGHT' AND lease_owner AND lease_token, so a
// relay whose lease expired and whose row was claimed again by another relay
// cannot overwrite what that relay wrote. Such a write matches no row and is
// reported as [Stale]: a possible duplicate publication, never an error that
// is swallowed. There is no unfenced way to change a row's state here.
//
// The fence can also sit on a lane instead of on each row (lanes.go,
// docs/FENCE.md): with [ClaimParams].Lanes a relay reads the claimable rows
// of the lanes it owns ([TakeLanes]) without writing them, and [Apply] writes
// each row once, its outcome, only while the row's lane is still the relay's
// at the epoch it read (the lane row held FOR SHARE, so a takeover waits for
// it) and the row still has the attempts it read. A relay that takes a lane
// whose lease expired charges an attempt to every row its previous owner
// held there without an outcome. [EnterFence] keeps one scheme per database
// (FENCE_SCHEME_CONFLICT), and [SetLaneCount] builds the lanes' index and
// changes their number while no lane is owned (LANES_BUSY).
//
// Guarantees, each shown by a test against a real PostgreSQL:
//
//   - Concurrent claims get disjoint rows (SKIP LOCKED) and every claim of a
//     row advances its token, so an expiry reclaim keeps the message id and
//     fences off the previous holder.
//   - A row is claimable when it is PENDING or AMBIGUOUS, has attempts left
//     (attempts < max) and its next_attempt_at is due; or when it is IN_FLIGHT
//     and its lease has expired.
//   - An expired lease is an attempt whose outcome nobody knows (the relay may
//     have sent the message before it died), so the reclaim counts it
//     (attempts + 1). When that spends the budget the same statement parks the
//     row EXHAUSTED with code LEASE_EXPIRED instead of claiming it, and returns
//     it so the relay reports it. A message that crashes every relay that
//     touches it therefore stops after max attempts, and an expired lease that
//     a claim reaches (in seq order, within its limit) is never left IN_FLIGHT.
//   - A PENDING or AMBIGUOUS row whose attempts already reach the budget
//     (MaxAttempts was lowered after they were spent) is not left waiting
//     forever, silently holding its key: the claim parks it EXHAUSTED with
//     code BUDGET_SPENT (the detail keeps its previous code), whatever its
//     next_attempt_at, under the same ordering rule as any claim, and
//     returns it not held, like an expired lease that spent the budget.
//   - Per-key ordering: a row with an ordering_key is claimable only as part
//     of its key's chain: the key's head (its earliest unpublished row), and
//     rows right behind a claimable head, in seq order, without a gap, up to
//     MaxChain. A row is never claimed while an earlier row of its key is
//     unpublished and not in the same chain, unless it continues a chain the
//     same owner holds ([Continuation]), so one key's rows are in flight with
//     one relay at a time, across any number of relays. The
//     [OrderingPolicy] says what a parked (FAILED/EXHAUSTED) earlier row does:
//     [BlockKey] (the default) holds the key until an operator redrives or
//     purges it; [SkipParked] lets later rows go past it. Order is seq order
//     among committed rows: seq is taken at insert, so two transactions
//     writing the same key concurrently may commit out of seq order, and a
//     later row can be published before an earlier one becomes visible
//     (publisher.Config.LockOrderingKeys makes seq order commit order).
//   - A claim is bounded by size as well as rows (ClaimParams.MaxBytes): the
//     statement cuts its rows in seq order where their payloads and headers
//     would exceed the budget, keeping the first whatever its size, so a
//     chain cut by it is still a prefix of its key's run.
//   - A claim is one statement that commits before the caller reads its
//     rows. When reading fails (a row the client cannot scan, a timeout, a
//     lost connection), [ReleaseUnheld] puts back the owner's IN_FLIGHT rows
//     that the caller does not hold, without spending attempts, instead of
//     leaving them to their leases' expiry (which spends one each).
//   - A row put back without an attempt while its destination was
//     unavailable waits out a hold-off (next_attempt_at); when the
//     destination is back, [EndHoldOff] makes such rows claimable at once.
//   - The attempt budget is judged on attempts after the attempt being
//     recorded (attempts + 1), so the last attempt is not spent twice; the
//     caller picks [MarkExhausted] instead of [MarkAmbiguous] when
//     Row.Attempts + 1 >= max.
//
// Cost: no index reads status, lease or attempt columns (migration 00030),
// so the claim is a HOT update wherever the row's page has room for the new
// version (the table's fillfactor, 50 since migration 00031, leaves room for
// all of a claim's rows; 70 for about 40%): a few hundred bytes of WAL and no index entry
// per row instead of a full row copy plus two index entries. The terminal
// write adds the row to the published index. [Prepared] runs the claim and [Apply] as prepared statements: the
// claim's planning would otherwise cost more than claiming 100 rows. [NewPreparedConn] does the same on one
// connection of a pool (the forwarder keeps its claims on one and its outcome writes on another while it drains).
// BENCHMARKS.md has the measurements.
//
// Cost of a blocked key: the claim walks keys, not rows (one index descent
// per key on messaging_outbox_ordering_head_idx), so a key whose head is
// parked, in flight or waiting for its retry costs one descent and one heap
// read, however many rows wait behind it (a test counts the buffers: the
// same with 10,000 and 20,000 rows behind a parked head). The walk is lazy:
// it stops once it has the rows it needs, and it starts after the key where
// the previous walk stopped (ClaimParams.KeyCursor). It still visits every
// key with unpublished rows when there is not enough claimable work: with
// many thousands of keys all blocked at once, an idle relay's claim grows
// with the number of keys (not of rows). Under write load each head lookup
// also crosses the index entries of the key's rows published since the last
// VACUUM (PostgreSQL cannot mark them dead while writers insert into the
// same pages), so the forwarder continues the keys it published lately
// (ClaimParams.Continue behind a published row) instead of walking them.
//
// Times: every statement takes an optional now (zero time = the server's
// now()), so lease expiry and retry schedules are tested without sleeping.
// Terminal transitions clear lease_expires_at but keep lease_owner and
// lease_token as the record of the last holder (outboxctl inspect shows it).
package fencing
