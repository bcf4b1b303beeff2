// The lane scheme's outcome statements.

package fencing

import (
	"strconv"
	"strings"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/lib/pq"
)

// The lane scheme's outcome statements: applySQL and applyPublishedSQL with
// the fence moved from the row's lease to its lane. Each first locks every
// lane of the owner ($4 / $2) FOR SHARE (a takeover's UPDATE of a lane waits
// until the outcome commits, and an outcome that waited for a takeover
// finds the lane changed), then writes a row only when its lane is still
// the owner's at the epoch its lease names and the row is as it was read:
// still claimable, with the attempts it had. The outcome is the row's only
// write: lease_owner and lease_token record who wrote it (the relay and
// the lane's epoch).
//
// The lanes are locked in lane order (the sort runs below the lock), as
// every statement that waits for a lane's lock takes it (lockOwnLanes): in
// the physical order of their row versions, which every UPDATE of a lane
// changes, an outcome and its relay's renewal locked two lanes in opposite
// orders and deadlocked (TestLaneLocksAreTakenInLaneOrder).
const laneFence = `
fence AS MATERIALIZED (
    SELECT array_agg(l.lane ORDER BY l.lane) AS lanes, array_agg(l.epoch ORDER BY l.lane) AS epochs
      FROM (SELECT l.lane, l.epoch FROM messaging_relay_lane l WHERE l.owner = {owner} ORDER BY l.lane FOR SHARE) l
)`

// unclaimedByID is "neither published nor parked" for a statement that
// finds its rows by message id: the two columns are tested through
// coalesce, so no partial index on "published_at IS NULL AND parked_at IS
// NULL" (the claimable indexes) matches the statement and the rows are
// probed through the primary key. Written as two IS NULL tests, the
// planner read the whole claimable index instead whenever its estimates
// made that index look small (stale statistics, a table that had grown):
// 18,000 entries filtered for an outcome of 1,000 rows on a fresh table,
// and every dead entry a held snapshot keeps besides (33,000 pages, 132
// ms a statement, after four rounds of 20,000 rows).
func unclaimedByID(a string) string {
	return `coalesce(` + a + `.published_at, ` + a + `.parked_at) IS NULL`
}

func laneFenceFor(lanes int, token, attempts string) string {
	// The fence is one row of arrays: reading it reads (and so locks)
	// every lane of the owner before the first row is written, and each
	// row finds its lane's epoch by position, computing its lane and token
	// once (a join with a CTE of lanes was planned as a nested loop that
	// computed them for every lane: 24 of a 32 ms write of 1,000 rows).
	return unclaimedByID("o") + `
   AND o.attempts = ` + attempts + `
   AND (SELECT f.epochs[array_position(f.lanes, (` + laneExpr("o", lanes) + `)::int)] FROM fence f) = ` + token
}

func laneApplySQL(lanes int) string {
	return laneStatement(laneKey{lanes, "apply"}, func() string {
		return `
WITH` + strings.ReplaceAll(laneFence, "{owner}", "$4") + `
UPDATE messaging_outbox o
   SET (status, attempts, published_at, next_attempt_at, last_failure_code, last_failure_detail, parked_at, last_attempt_at) = (
       SELECT ` + outcomeStatus + `,
              o.attempts + CASE WHEN u.to_status = 'PENDING' THEN 0 ELSE 1 END + CASE WHEN o.status = 'IN_FLIGHT' THEN 1 ELSE 0 END,
` + outcomeColumns + `,
              CASE WHEN u.to_status = 'PENDING' THEN o.last_attempt_at ELSE c.t END
` + outcomeSource + `),
       lease_owner = $4,
       lease_token = ($3::jsonb -> o.message_id ->> 'token')::int8,
       lease_expires_at = NULL
 WHERE o.message_id = ANY ($2::text[])
   AND ` + laneFenceFor(lanes, "($3::jsonb -> o.message_id ->> 'token')::int8", "($3::jsonb -> o.message_id ->> 'attempts')::int") + `
RETURNING o.message_id`
	})
}

func laneApplyPublishedSQL(lanes int) string {
	return laneStatement(laneKey{lanes, "apply-published"}, func() string {
		return `
WITH` + strings.ReplaceAll(laneFence, "{owner}", "$2") + `
UPDATE messaging_outbox o
   SET status = 'PUBLISHED',
       attempts = o.attempts + CASE WHEN o.status = 'IN_FLIGHT' THEN 2 ELSE 1 END,
       published_at = coalesce($1::timestamptz, now()),
       last_attempt_at = coalesce($1::timestamptz, now()),
       next_attempt_at = NULL,
       lease_owner = $2,
       lease_token = ($4::jsonb -> o.message_id ->> 0)::int8,
       lease_expires_at = NULL
 WHERE o.message_id = ANY ($3::text[])
   AND ` + laneFenceFor(lanes, "($4::jsonb -> o.message_id ->> 0)::int8", "($4::jsonb -> o.message_id ->> 1)::int") + `
RETURNING o.message_id`
	})
}

// laneApplyStatement is applyStatement for lane leases (all of one owner,
// checked by Apply).
func laneApplyStatement(outcomes []Outcome, general bool) (string, []any) {
	lanes := outcomes[0].Lease.Lanes
	ids := make([]string, len(outcomes))
	for i, o := range outcomes {
		ids[i] = o.Lease.MessageID
	}
	var b jsonObject
	if !general {
		for _, o := range outcomes {
			b.key(o.Lease.MessageID)
			b.buf = append(b.buf, '[')
			b.buf = strconv.AppendInt(b.buf, o.Lease.Token, 10)
			b.buf = append(b.buf, ',')
			b.buf = strconv.AppendInt(b.buf, int64(o.Lease.Attempts), 10)
			b.buf = append(b.buf, ']')
		}
		return laneApplyPublishedSQL(lanes), []any{nowArg(outcomes[0].Now), outcomes[0].Lease.Owner, pq.Array(ids), b.close()}
	}
	for _, o := range outcomes {
		appendOutcome(&b, o)
		b.buf = b.buf[:len(b.buf)-1] // reopen the member to add the attempts read
		b.buf = append(b.buf, `,"attempts":`...)
		b.buf = strconv.AppendInt(b.buf, int64(o.Lease.Attempts), 10)
		b.buf = append(b.buf, '}')
	}
	return laneApplySQL(lanes), []any{nowArg(outcomes[0].Now), pq.Array(ids), b.close(), outcomes[0].Lease.Owner}
}

// plainRelease reports whether o gives a lane-held row back without
// anything to record: the row is as it was read, so nothing is written.
func plainRelease(o Outcome) bool {
	return o.Lease.Lanes > 0 && o.To == envelope.StatusPending && o.Code == "" && o.RetryAfter == 0
}
