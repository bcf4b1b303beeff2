package chaos_test

import (
	"database/sql"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// The bounds on each relay process's goroutines, stated here and derived
// from its configuration:
//
//   - goroutineBaseline: everything a relay runs that does not depend on
//     its publishes (main, signal handling, the forwarder's loop, heartbeat,
//     LISTEN connection and prefetch, the database/sql pools and lib/pq's
//     cancel watchers of the statements in flight on the 4 + 3 connections,
//     the gauge's sampler, timers firing), with a wide margin, which a
//     relay on lanes needs: it also advances its lanes' floors beside its
//     claims (a goroutine and its statement's watcher), and while the
//     database restarts or is cut off every statement that times out
//     leaves a lib/pq cancel request dialing it and database/sql opens
//     connections in goroutines of their own, for a moment each (a lane
//     relay was sampled at 48 against the 44 this bound allowed when the
//     baseline was 28);
//   - plus relayConcurrency workers, plus the publishes left behind by
//     their timeout that may still run: at most MaxAbandoned, plus one per
//     worker (a publish starts only while no more than MaxAbandoned are left
//     behind, and the ones running then may all be left behind too).
//
// Without MaxAbandoned, a downstream that hangs forever leaves a goroutine
// per timed-out attempt: four per PublishTimeout (500 ms) per relay, over
// the hang window, past this bound within seconds.
const (
	goroutineBaseline = 36
	goroutineBound    = goroutineBaseline + relayConcurrency + relayMaxAbandoned + relayConcurrency
	// After the drain, with its pools closed: main and the runtime's own,
	// plus, for a relay stopped while its publishes hang, those publishes.
	finalBaseline = 8
	finalHanging  = relayMaxAbandoned + relayConcurrency
	// Heap in use after the drain and a GC: nothing of the batches is
	// kept (a batch can hold 20 rows of 256 KiB, twice with prefetch).
	heapBound = 16 << 20
)

type row struct {
	status, key, owner, code string
	seq, token               int64
	fatedReject, expired     bool
	archived                 bool
}

type delivery struct {
	id, logical, key, owner, outcome string
	token                            int64
	at                               time.Time
}

type summary struct {
	policy                                           string
	committed, rolledBackTx, rolledBackMsgs, commits int
	unknownTx, unknownCommitted                      int
	deliveries, delivered, duplicates                int
	published, archived, failed, exhausted, blocked  int
	purged, lost                                     int
	poisonParked                                     int
	large, largeDelivered                            int
	staleReported, staleEvidence, unwritten          int
	confirmedLate, attempts                          int
	unrecordedReported, unrecordedObserved           int
	claimFailures, claimReleased                     int
	killed                                           int
	faults                                           map[string]int
	// new in issue 16's second half
	restartSkipped                                     string
	restarts                                           []restartRecord
	hang                                               hangRecord
	hungRows, hungRedelivered, hungRejected, hungOther int
	pausedPasses, maxAbandoned, maxGoroutines          int
	termed                                             []termedRelay
	finals                                             int
	finalMaxGoroutines                                 int
	finalMaxHeap                                       uint64
	ret                                                retentionTotals
	redrives, redriven, healedDelivered, reparked      int
	purges, refusedAgain, opIdle                       int
	parkEvents                                         int
	effects, inboxHandled, inboxErrors, inboxCrashes   int
	inboxReplayed                                      int
	skippedPast                                        int // first deliveries past a parked earlier row of their key (SkipParked)
	passedPurged                                       int // first deliveries past a purged earlier row of their key
}

func (s summary) String(form string, seed uint64, policy fencing.OrderingPolicy) string {
	var b strings.Builder
	fmt.Fprintf(&b, "chaos soak summary (%s, %s, seed %d)\n", form, policy, seed)
	fmt.Fprintf(&b, "  messages committed      %d (in %d transactions)\n", s.committed, s.commits)
	fmt.Fprintf(&b, "  messages rolled back    %d (in %d transactions; delivered: 0)\n", s.rolledBackMsgs, s.rolledBackTx)
	fmt.Fprintf(&b, "  producer txs cut        %d by the restarts (connection lost; committed after all: %d, settled by their business row)\n", s.unknownTx, s.unknownCommitted)
	fmt.Fprintf(&b, "  deliveries              %d (distinct messages %d, duplicates %d)\n", s.deliveries, s.delivered, s.duplicates)
	fmt.Fprintf(&b, "  rows PUBLISHED          %d (+ %d PUBLISHED and archived by retention)\n", s.published, s.archived)
	fmt.Fprintf(&b, "  parked FAILED           %d\n", s.failed)
	fmt.Fprintf(&b, "  parked EXHAUSTED        %d\n", s.exhausted)
	fmt.Fprintf(&b, "  blocked behind parked   %d\n", s.blocked)
	fmt.Fprintf(&b, "  purged                  %d (parked rows, never delivered)\n", s.purged)
	fmt.Fprintf(&b, "  accounted               %d = %d published + %d archived + %d failed + %d exhausted + %d blocked + %d purged + %d lost\n",
		s.published+s.archived+s.failed+s.exhausted+s.blocked+s.purged+s.lost, s.published, s.archived, s.failed, s.exhausted, s.blocked, s.purged, s.lost)
	fmt.Fprintf(&b, "  key order               %s: first deliveries in seq order; past a parked earlier row %d, past a purged one %d\n", policy, s.skippedPast, s.passedPurged)
	fmt.Fprintf(&b, "  stale writes reported   %d (confirmed deliveries whose outcome was overwritten: %d, all reported)\n", s.staleReported, s.staleEvidence)
	fmt.Fprintf(&b, "  confirmed too late      %d (confirmed by the downstream after the relay had left the publish behind at its timeout, by the relay's publish spans: %d attempts logged)\n", s.confirmedLate, s.attempts)
	fmt.Fprintf(&b, "  poison rows parked      %d (written by SQL beside good rows; FAILED with their reason, never delivered)\n", s.poisonParked)
	fmt.Fprintf(&b, "  large payloads          %d committed (%d KiB each, over the proxied links), %d delivered (the rest parked, or held behind a parked row of their key: checked with every row)\n", s.large, largePayload>>10, s.largeDelivered)
	fmt.Fprintf(&b, "  outcome writes failed   %d (rows of failed outcome statements, logged by id and lease token)\n", s.unwritten)
	fmt.Fprintf(&b, "  unrecorded publishes    %d reported in Report.UnrecordedPublishes (confirmed deliveries among the failed outcome writes: %d)\n", s.unrecordedReported, s.unrecordedObserved)
	fmt.Fprintf(&b, "  failed claims           %d (rows released without an attempt: %d)\n", s.claimFailures, s.claimReleased)
	if s.restartSkipped != "" {
		fmt.Fprintf(&b, "  PostgreSQL restarts     SKIPPED: %s\n", s.restartSkipped)
	} else {
		fmt.Fprintf(&b, "  PostgreSQL restarts     %d:", len(s.restarts))
		for _, r := range s.restarts {
			fmt.Fprintf(&b, " [-m %s, down %s, %d/%d relays beating again %s after]", r.mode, r.down.Round(time.Millisecond), r.beaten, r.witnesses, r.recovered.Round(time.Millisecond))
		}
		fmt.Fprintf(&b, "\n")
	}
	extended := ""
	if s.hang.extended > 0 {
		extended = fmt.Sprintf(" (%ds of it added until a relay reported its claims paused)", s.hang.extended)
	}
	fmt.Fprintf(&b, "  hanging downstream      %s window%s; %d rows hung (%d delivered again after it, %d rejected after it, %d otherwise settled); passes with claims paused %d; max abandoned reported %d (bound %d)\n",
		s.hang.until.Sub(s.hang.from).Round(time.Millisecond), extended, s.hungRows, s.hungRedelivered, s.hungRejected, s.hungOther, s.pausedPasses, s.maxAbandoned, relayMaxAbandoned+relayConcurrency)
	fmt.Fprintf(&b, "  SIGTERM while hanging   %d relays drained and exited 0", len(s.termed))
	for _, r := range s.termed {
		fmt.Fprintf(&b, " [%s in %s: goroutines %d at exit]", r.owner, r.took.Round(time.Millisecond), r.final.goroutines)
	}
	if s.hang.termsSkipped != "" {
		fmt.Fprintf(&b, " (not done: %s)", s.hang.termsSkipped)
	}
	fmt.Fprintf(&b, "\n")
	fmt.Fprintf(&b, "  goroutines per relay    max %d sampled over the run (bound %d = %d baseline + %d workers + %d MaxAbandoned + %d)\n",
		s.maxGoroutines, goroutineBound, goroutineBaseline, relayConcurrency, relayMaxAbandoned, relayConcurrency)
	fmt.Fprintf(&b, "  at exit after drain     %d relays: goroutines max %d (bound %d), heap in use max %.1f MiB (bound %d MiB)\n",
		s.finals, s.finalMaxGoroutines, finalBaseline, float64(s.finalMaxHeap)/(1<<20), heapBound>>20)
	fmt.Fprintf(&b, "  retention (archive)     %d runs (%d skipped), %d batches, %d rows archived (all found in the archive), duplicates %d, conflicts %d\n",
		s.ret.runs, s.ret.skipped, s.ret.batches, s.ret.archived, s.ret.duplicates, s.ret.conflicts)
	fmt.Fprintf(&b, "  redrive                 %d tickets, %d rows (healed and delivered after it: %d; parked again: %d); park events %d\n",
		s.redrives, s.redriven, s.healedDelivered, s.reparked, s.parkEvents)
	fmt.Fprintf(&b, "  purge                   %d tickets, %d rows; second executions refused %d; operator ticks with nothing parked %d\n",
		s.purges, s.purged, s.refusedAgain, s.opIdle)
	fmt.Fprintf(&b, "  inbox consumer          %d deliveries handled (replayed after crashes %d, handler failures %d, crashes %d), effects %d: exactly 1 per delivered message\n",
		s.inboxHandled, s.inboxReplayed, s.inboxErrors, s.inboxCrashes, s.effects)
	kinds := make([]string, 0, len(s.faults))
	for k := range s.faults {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	fmt.Fprintf(&b, "  faults injected        ")
	for _, k := range kinds {
		fmt.Fprintf(&b, " %s=%d", k, s.faults[k])
	}
	fmt.Fprintf(&b, "\n  relay incarnations killed %d\n", s.killed)
	fmt.Fprintf(&b, "  lost                    %d\n", s.lost)
	return b.String()
}

type lease struct {
	owner, id string
	token     int64
}

const selectRowsFrom = `SELECT message_id, status, seq, coalesce(ordering_key, ''), coalesce(lease_owner, ''), lease_token,
       coalesce(last_failure_code, ''), headers->>'chaos-fate' IS NOT NULL,
       lease_expires_at IS NOT NULL AND lease_expires_at < now()
  FROM `

func check(t *testing.T, db, ev *sql.DB, l *ledger, fl *fleet, op *operator, cons *consumer, inj *injector,
	policy fencing.OrderingPolicy, cfg soakConfig, finals map[string]finalLine) summary {
	t.Helper()
	sum := summary{policy: policy.String()}
	l.mu.Lock()
	defer l.mu.Unlock()
	op.mu.Lock()
	defer op.mu.Unlock()

	// Transactions whose commit a restart cut: settled by their business
	// row (committed with all their messages, or not at all).
	var unknownTx []string
	for tx := range l.unknown {
		unknownTx = append(unknownTx, tx)
	}
	committedUnknown := map[string]bool{}
	if len(unknownTx) > 0 {
		rs, err := db.Query(`SELECT tx_id FROM chaos_business WHERE tx_id = ANY($1::text[])`, pq.Array(unknownTx))
		require.NoError(t, err)
		for rs.Next() {
			var tx string
			require.NoError(t, rs.Scan(&tx))
			committedUnknown[tx] = true
		}
		require.NoError(t, rs.Err())
	}
	sum.unknownTx, sum.unknownCommitted = len(unknownTx), len(committedUnknown)
	for tx, ids := range l.unknown {
		for _, id := range ids {
			if committedUnknown[tx] {
				l.committed[id] = true
				if l.unknownPoison[id] {
					l.poison[id] = true
				}
			} else {
				l.rolledBack[id] = true
				delete(l.large, id)
			}
		}
	}
	// Every business row a producer committed is there; none of a
	// rolled-back transaction is.
	for tx := range l.committedTx {
		var ok bool
		require.NoError(t, db.QueryRow(`SELECT EXISTS (SELECT 1 FROM chaos_business WHERE tx_id = $1)`, tx).Scan(&ok))
		require.True(t, ok, "business row %s of a committed transaction vanished", tx)
	}
	sum.committed, sum.commits = len(l.committed), l.commits+len(committedUnknown)
	sum.rolledBackMsgs, sum.rolledBackTx = len(l.rolledBack), l.rollbacks
	require.Positive(t, sum.committed)

	rows := map[string]*row{}
	for _, src := range []struct {
		table    string
		archived bool
	}{{"messaging_outbox", false}, {"messaging_outbox_archive", true}} {
		rs, err := db.Query(selectRowsFrom + src.table)
		require.NoError(t, err)
		for rs.Next() {
			var id string
			r := &row{archived: src.archived}
			require.NoError(t, rs.Scan(&id, &r.status, &r.seq, &r.key, &r.owner, &r.token, &r.code, &r.fatedReject, &r.expired))
			require.NotContains(t, rows, id, "message %s is both in the outbox and in the archive", id)
			rows[id] = r
		}
		require.NoError(t, rs.Err())
	}

	var deliveries []delivery
	ds, err := ev.Query(`SELECT message_id, logical_id, coalesce(ordering_key, ''), owner, lease_token, outcome, at
  FROM chaos_delivery ORDER BY delivery_id`)
	require.NoError(t, err)
	for ds.Next() {
		var d delivery
		require.NoError(t, ds.Scan(&d.id, &d.logical, &d.key, &d.owner, &d.token, &d.outcome, &d.at))
		deliveries = append(deliveries, d)
	}
	require.NoError(t, ds.Err())
	sum.deliveries = len(deliveries)

	// Committed = stored (in the outbox, in the archive) or purged; rolled
	// back = absent and never delivered.
	for id := range l.committed {
		_, purged := op.purged[id]
		require.True(t, rows[id] != nil || purged, "committed message %s has no row (nor was it purged)", id)
		require.False(t, rows[id] != nil && purged, "purged message %s still has a row", id)
	}
	for id := range rows {
		require.True(t, l.committed[id], "row %s was not committed by a producer", id)
	}
	delivered := map[string]int{}
	firstAt := map[string]time.Time{}
	for _, d := range deliveries {
		require.False(t, l.rolledBack[d.id], "message %s from a rolled-back transaction was delivered", d.id)
		// A duplicate is the same message under the same id: the id the
		// producer put in the payload is the id the downstream saw.
		require.Equal(t, d.logical, d.id, "delivery under a re-minted id")
		if delivered[d.id] == 0 {
			firstAt[d.id] = d.at
		}
		delivered[d.id]++
	}
	sum.delivered = len(delivered)
	for id := range l.large {
		sum.large++
		if delivered[id] > 0 {
			sum.largeDelivered++
		}
	}
	sum.duplicates = sum.deliveries - sum.delivered

	// The park log, and the operator's redrives per row.
	parks := map[string][]time.Time{}
	pl, err := db.Query(`SELECT message_id, at FROM chaos_parklog ORDER BY at`)
	require.NoError(t, err)
	for pl.Next() {
		var id string
		var at time.Time
		require.NoError(t, pl.Scan(&id, &at))
		parks[id] = append(parks[id], at)
		sum.parkEvents++
	}
	require.NoError(t, pl.Err())
	redrivenBy := map[string][]opRecord{}
	for _, rd := range op.redrives {
		sum.redrives++
		for _, id := range rd.ids {
			redrivenBy[id] = append(redrivenBy[id], rd)
			sum.redriven++
		}
	}
	sum.purges = len(op.purges)
	sum.refusedAgain, sum.opIdle = op.refused, op.idle
	require.Equal(t, sum.redrives+sum.purges, op.refused, "every ticket's second execution must be refused")
	// parkedAt: r was (or may have been) parked at instant at: parked
	// before it, and no redrive of it surely finished between the two.
	parkedAt := func(id string, at time.Time) bool {
		for _, p := range parks[id] {
			if !p.Before(at) {
				continue
			}
			redriven := false
			for _, rd := range redrivenBy[id] {
				if rd.start.After(p) && rd.end.Before(at) {
					redriven = true
				}
			}
			if !redriven {
				return true
			}
		}
		return false
	}
	purgedBefore := func(id string, at time.Time) bool {
		p, ok := op.purged[id]
		return ok && p.purgeStart.Before(at)
	}

	// Per ordering key, in the log's order (an identity column; a key's
	// next row is claimed only after the previous one's delivery
	// committed, so log order is real-time order): the first delivery of
	// each message comes after the first deliveries of every earlier row
	// of its key, except rows gone by then (purged by the operator) and,
	// under SkipParked, rows parked at that moment (the park log, and the
	// operator's redrives). Under BlockKey a parked row holds its key back.
	// Any other delivery is a duplicate of a message delivered before.
	type keyed struct {
		id  string
		seq int64
	}
	byKey := map[string][]keyed{}
	for id, r := range rows {
		if r.key != "" {
			byKey[r.key] = append(byKey[r.key], keyed{id, r.seq})
		}
	}
	for id, p := range op.purged {
		if p.key != "" {
			byKey[p.key] = append(byKey[p.key], keyed{id, p.seq})
		}
	}
	for k := range byKey {
		sort.Slice(byKey[k], func(i, j int) bool { return byKey[k][i].seq < byKey[k][j].seq })
	}
	firstSeen := map[string]bool{}
	badKeys := map[string]bool{}
	for _, d := range deliveries {
		r := rows[d.id]
		if r == nil || r.key == "" || firstSeen[d.id] {
			continue
		}
		firstSeen[d.id] = true
		for _, e := range byKey[r.key] {
			if e.seq >= r.seq {
				break
			}
			if firstSeen[e.id] {
				continue
			}
			switch {
			case purgedBefore(e.id, d.at):
				sum.passedPurged++
			case policy == fencing.SkipParked && parkedAt(e.id, d.at):
				sum.skippedPast++
			default:
				if !badKeys[r.key] {
					badKeys[r.key] = true
					t.Errorf("key %s (%s): first delivery of seq %d at %s while seq %d (%s) was neither delivered, parked (SkipParked only) nor purged",
						r.key, policy, r.seq, d.at.Format(time.RFC3339Nano), e.seq, e.id)
				}
			}
		}
	}

	// Every committed message is delivered, parked with a reason, purged,
	// or (BlockKey) held back by a parked earlier row of its key; nothing
	// else (lost).
	bySeq := map[int64]*row{}
	for _, r := range rows {
		bySeq[r.seq] = r
	}
	parked := func(r *row) bool {
		return r.status == string(envelope.StatusFailed) || r.status == string(envelope.StatusExhausted)
	}
	heldBack := func(r *row) bool {
		if policy != fencing.BlockKey || r.key == "" {
			return false
		}
		for _, e := range byKey[r.key] {
			if e.seq >= r.seq {
				return false
			}
			if o := bySeq[e.seq]; o != nil && parked(o) {
				return true
			}
		}
		return false
	}
	for id, p := range op.purged {
		require.Zero(t, delivered[id], "purged row %s (%s %s) had been delivered", id, p.status, p.code)
		require.False(t, op.healed[id], "purged row %s was healed for a redrive", id)
		sum.purged++
	}
	for id, r := range rows {
		require.False(t, r.expired && r.status == string(envelope.StatusInFlight), "row %s left IN_FLIGHT with an expired lease", id)
		require.NotEqual(t, string(envelope.StatusInFlight), r.status, "row %s left IN_FLIGHT after the relays drained", id)
		if r.archived {
			require.Equal(t, string(envelope.StatusPublished), r.status, "archived row %s", id)
		}
		switch {
		case l.poison[id]:
			require.Equal(t, string(envelope.StatusFailed), r.status, "poison row %s", id)
			require.Contains(t, []string{"OUTBOX_CORRUPT_ROW", "OUTBOX_RESERVED_HEADER"}, r.code, "poison row %s", id)
			require.Zero(t, delivered[id], "poison row %s was delivered", id)
			sum.poisonParked++
			sum.failed++
		case r.fatedReject && op.healed[id]:
			// Healed, then redriven: delivered after its redrive, not before.
			require.Equal(t, string(envelope.StatusPublished), r.status, "healed and redriven message %s", id)
			require.Positive(t, delivered[id], "healed and redriven message %s was never delivered", id)
			rds := redrivenBy[id]
			require.NotEmpty(t, rds, "healed message %s was not redriven", id)
			require.True(t, firstAt[id].After(rds[0].start), "healed message %s was delivered before its redrive", id)
			sum.healedDelivered++
			if r.archived {
				sum.archived++
			} else {
				sum.published++
			}
		case r.fatedReject && heldBack(r):
			sum.blocked++
		case r.fatedReject:
			require.Equal(t, string(envelope.StatusFailed), r.status, "message %s the downstream rejects", id)
			require.Equal(t, "CHAOS_REJECTED", r.code)
			require.Zero(t, delivered[id], "a rejected message was delivered")
			sum.failed++
		case r.status == string(envelope.StatusPublished):
			require.Positive(t, delivered[id], "row %s is PUBLISHED but was never delivered", id)
			if r.archived {
				sum.archived++
			} else {
				sum.published++
			}
		case parked(r):
			require.NotEmpty(t, r.code, "parked row %s without a reason", id)
			if r.status == string(envelope.StatusFailed) {
				sum.failed++
			} else {
				sum.exhausted++
			}
		case heldBack(r):
			sum.blocked++
		default:
			sum.lost++
			t.Errorf("lost: message %s is %s (%s) and not held back by a parked row", id, r.status, policy)
		}
	}
	require.Equal(t, sum.committed, sum.published+sum.archived+sum.failed+sum.exhausted+sum.blocked+sum.purged+sum.lost,
		"every committed message is accounted for once")

	// Parked as often as redriven, plus once if it ends parked or purged:
	// a redrive is done once per ticket, and each redriven row that is not
	// delivered after it is parked exactly once more, after the redrive.
	for id := range l.committed {
		r := rows[id]
		_, purged := op.purged[id]
		want := len(redrivenBy[id])
		if purged || (r != nil && parked(r)) {
			want++
		}
		require.Len(t, parks[id], want, "message %s: park events vs redrives (%d) and its end (%v, purged %v)", id, len(redrivenBy[id]), r, purged)
		if rds := redrivenBy[id]; len(rds) > 0 && want > len(rds) {
			last := parks[id][len(parks[id])-1]
			require.True(t, last.After(rds[len(rds)-1].start), "message %s parked again before its last redrive", id)
			sum.reparked++
		}
	}

	// Stale writes. Reported ones must be real (someone claimed the row
	// after this lease), every confirmed delivery whose PUBLISHED was not
	// written under its own lease must have been reported stale, unless the
	// relay died or its pass failed writing outcomes, and per surviving
	// relay the Report.Stale sum equals the stale events it logged.
	stale := loadLeases(t, ev, `SELECT owner, message_id, lease_token FROM chaos_stale`)
	unwritten := loadLeases(t, ev, `SELECT owner, message_id, lease_token FROM chaos_unwritten`)
	sum.staleReported, sum.unwritten = len(stale), len(unwritten)
	for lz := range stale {
		if _, purged := op.purged[lz.id]; purged {
			continue // gone: its last token is not known any more
		}
		require.Greater(t, rows[lz.id].token, lz.token, "stale report for %s token %d, but no later lease exists", lz.id, lz.token)
	}
	fl.mu.Lock()
	killed := fl.killed
	sum.killed = len(killed)
	fl.mu.Unlock()
	// How each relay saw its own publish attempts (its publish spans): a
	// delivery the downstream confirmed after the relay had left the
	// publish behind at its timeout is, for the relay, a timeout, and
	// rightly not written PUBLISHED under that lease.
	attempts := map[lease]bool{}
	at, err := ev.Query(`SELECT owner, message_id, lease_token, ok FROM chaos_attempt`)
	require.NoError(t, err)
	for at.Next() {
		var lz lease
		var ok bool
		require.NoError(t, at.Scan(&lz.owner, &lz.id, &lz.token, &ok))
		attempts[lz] = ok
	}
	require.NoError(t, at.Err())
	sum.attempts = len(attempts)
	for _, d := range deliveries {
		if d.outcome != "confirmed" {
			continue
		}
		if ok, seen := attempts[lease{d.owner, d.id, d.token}]; seen && !ok {
			sum.confirmedLate++
			continue
		}
		r := rows[d.id]
		if r.status == string(envelope.StatusPublished) && r.owner == d.owner && r.token == d.token {
			continue
		}
		lz := lease{d.owner, d.id, d.token}
		switch {
		case stale[lz]:
			sum.staleEvidence++
		case unwritten[lz] || killed[d.owner]:
		default:
			t.Errorf("confirmed delivery of %s by %s (token %d) was overwritten (row %s by %s token %d) and not reported stale",
				d.id, d.owner, d.token, r.status, r.owner, r.token)
		}
	}
	perOwner := map[string][2]int{}
	rep, err := ev.Query(`SELECT owner, sum(stale)::int FROM chaos_report GROUP BY owner`)
	require.NoError(t, err)
	for rep.Next() {
		var o string
		var n int
		require.NoError(t, rep.Scan(&o, &n))
		v := perOwner[o]
		v[0] = n
		perOwner[o] = v
	}
	require.NoError(t, rep.Err())
	for lz := range stale {
		v := perOwner[lz.owner]
		v[1]++
		perOwner[lz.owner] = v
	}
	for o, v := range perOwner {
		if !killed[o] {
			require.Equal(t, v[1], v[0], "relay %s: Report.Stale total vs stale events logged", o)
		}
	}

	// Possible duplicates from failed outcome writes: every row a surviving
	// relay counted in Report.UnrecordedPublishes is a confirmed delivery
	// among the rows of its failed outcome statements. (Not always all of
	// them: a publish that the downstream confirmed just as its timeout
	// left it behind is ambiguous for the relay, a possible duplicate it
	// already counts when the row goes out again.)
	reported := map[string]int{}
	rep, err = ev.Query(`SELECT owner, sum(unrecorded)::int, sum(claim_failures)::int, sum(claim_released)::int FROM chaos_report GROUP BY owner`)
	require.NoError(t, err)
	for rep.Next() {
		var o string
		var u, cf, cr int
		require.NoError(t, rep.Scan(&o, &u, &cf, &cr))
		reported[o] = u
		sum.unrecordedReported += u
		sum.claimFailures += cf
		sum.claimReleased += cr
	}
	require.NoError(t, rep.Err())
	observed := map[string]int{}
	for _, d := range deliveries {
		if d.outcome == "confirmed" && unwritten[lease{d.owner, d.id, d.token}] {
			observed[d.owner]++
			sum.unrecordedObserved++
		}
	}
	for o, n := range reported {
		if !killed[o] {
			require.LessOrEqual(t, n, observed[o], "relay %s: Report.UnrecordedPublishes vs confirmed deliveries whose outcome write failed", o)
		}
	}

	checkHang(t, ev, &sum, inj, rows, deliveries, op, fl.lanes)
	checkBounds(t, ev, &sum, fl, finals)
	checkInbox(t, ev, &sum, delivered, cons)
	checkRetention(t, db, &sum, op)
	inj.mu.Lock()
	sum.restarts = append([]restartRecord(nil), inj.restarts...)
	inj.mu.Unlock()
	if inj.cluster != nil {
		require.Len(t, sum.restarts, cfg.restarts, "PostgreSQL restarts done")
	}
	return sum
}

// checkHang: the downstream hung forever over a window. The relays stopped
// claiming and said so (Report.ClaimPaused), and every row whose publish
// hung was published again after the window (a delivery under a later
// lease, after the window's end), unless the downstream rejects it for
// good or it is settled otherwise (checked with every row). On lanes the
// token is the lane's epoch, which a relay that kept its lane keeps, so a
// delivery after the window's end is the evidence there.
func checkHang(t *testing.T, ev *sql.DB, sum *summary, inj *injector, rows map[string]*row, deliveries []delivery, op *operator, lanes bool) {
	inj.mu.Lock()
	sum.hang = inj.hang
	inj.mu.Unlock()
	if !sum.hang.on {
		t.Errorf("the hang window never started")
		return
	}
	hung := map[string]int64{}
	rs, err := ev.Query(`SELECT message_id, max(lease_token) FROM chaos_hung GROUP BY message_id`)
	require.NoError(t, err)
	for rs.Next() {
		var id string
		var tok int64
		require.NoError(t, rs.Scan(&id, &tok))
		hung[id] = tok
	}
	require.NoError(t, rs.Err())
	sum.hungRows = len(hung)
	require.Positive(t, sum.hungRows, "no publish hung in the hang window")
	after := map[string]bool{}
	for _, d := range deliveries {
		if _, ok := hung[d.id]; ok && lanes && !d.at.Before(sum.hang.until) {
			after[d.id] = true
			continue
		}
		if tok, ok := hung[d.id]; ok && !lanes && d.token > tok {
			require.False(t, d.at.Before(sum.hang.until), "message %s delivered under lease %d at %s, inside the hang window (until %s)",
				d.id, d.token, d.at.Format(time.RFC3339Nano), sum.hang.until.Format(time.RFC3339Nano))
			after[d.id] = true
		}
	}
	for id := range hung {
		r := rows[id]
		switch {
		case r != nil && r.status == string(envelope.StatusPublished):
			require.True(t, after[id], "message %s hung, then ended PUBLISHED without a delivery after the hang window", id)
			sum.hungRedelivered++
		case r != nil && r.fatedReject && r.status == string(envelope.StatusFailed):
			sum.hungRejected++
		default:
			sum.hungOther++ // parked, purged or held back: checked with every row
		}
	}
	require.Positive(t, sum.hungRedelivered, "no row that hung was delivered after the window")
}

// checkBounds: goroutines bounded all along in every relay (sampled by
// relayproc into chaos_gauge), Reports consistent about paused claims,
// and at exit after the drain goroutines and heap in use within bounds.
func checkBounds(t *testing.T, ev *sql.DB, sum *summary, fl *fleet, finals map[string]finalLine) {
	rs, err := ev.Query(`SELECT owner, max_goroutines, max_abandoned, paused_passes, claimed_while_paused FROM chaos_gauge`)
	require.NoError(t, err)
	for rs.Next() {
		var owner string
		var g, a, p, cwp int
		require.NoError(t, rs.Scan(&owner, &g, &a, &p, &cwp))
		require.LessOrEqual(t, g, goroutineBound, "relay %s: %d goroutines at once", owner, g)
		require.LessOrEqual(t, a, relayMaxAbandoned+relayConcurrency, "relay %s: %d publishes left behind at once", owner, a)
		require.Zero(t, cwp, "relay %s: passes that reported ClaimPaused with rows claimed", owner)
		sum.maxGoroutines = max(sum.maxGoroutines, g)
		sum.maxAbandoned = max(sum.maxAbandoned, a)
		sum.pausedPasses += p
	}
	require.NoError(t, rs.Err())
	require.Positive(t, sum.pausedPasses, "no relay reported its claims paused while the downstream hung")
	fl.mu.Lock()
	sum.termed = append([]termedRelay(nil), fl.termed...)
	fl.mu.Unlock()
	for _, r := range sum.termed {
		require.LessOrEqual(t, r.final.goroutines, finalBaseline+finalHanging, "relay %s stopped while hanging: goroutines at exit", r.owner)
		require.LessOrEqual(t, r.final.heapInuse, uint64(heapBound), "relay %s stopped while hanging: heap in use at exit", r.owner)
	}
	require.NotEmpty(t, finals, "no relay printed its final line")
	for owner, f := range finals {
		require.LessOrEqual(t, f.goroutines, finalBaseline, "relay %s: goroutines at exit after the drain", owner)
		require.LessOrEqual(t, f.heapInuse, uint64(heapBound), "relay %s: heap in use at exit after the drain", owner)
		sum.finals++
		sum.finalMaxGoroutines = max(sum.finalMaxGoroutines, f.goroutines)
		sum.finalMaxHeap = max(sum.finalMaxHeap, f.heapInuse)
	}
}

// checkInbox: every delivered message has exactly one effect, and none
// other has any; the inbox recorded each once.
func checkInbox(t *testing.T, ev *sql.DB, sum *summary, delivered map[string]int, cons *consumer) {
	effects := map[string]int{}
	rs, err := ev.Query(`SELECT message_id, count(*) FROM chaos_effect GROUP BY message_id`)
	require.NoError(t, err)
	for rs.Next() {
		var id string
		var n int
		require.NoError(t, rs.Scan(&id, &n))
		effects[id] = n
		sum.effects += n
	}
	require.NoError(t, rs.Err())
	for id := range delivered {
		require.Equal(t, 1, effects[id], "message %s: effects (delivered %d times)", id, delivered[id])
	}
	for id, n := range effects {
		require.Positive(t, delivered[id], "message %s has %d effects and was never delivered", id, n)
	}
	var inboxRows int
	require.NoError(t, ev.QueryRow(`SELECT count(*) FROM messaging_inbox WHERE consumer = $1`, consumerName).Scan(&inboxRows))
	require.Equal(t, len(delivered), inboxRows, "inbox records vs delivered messages")
	cons.mu.Lock()
	sum.inboxHandled, sum.inboxErrors, sum.inboxCrashes, sum.inboxReplayed = cons.handled, cons.handlerErrors, cons.crashes, cons.replayed
	cons.mu.Unlock()
	require.GreaterOrEqual(t, sum.inboxHandled, sum.deliveries, "the consumer handled fewer deliveries than the log holds")
}

// checkRetention: what retention archived is in the archive, exactly.
func checkRetention(t *testing.T, db *sql.DB, sum *summary, op *operator) {
	sum.ret = op.ret
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM messaging_outbox_archive`).Scan(&n))
	require.Equal(t, sum.ret.archived, n, "rows retention reported archived vs rows in the archive")
	require.Equal(t, sum.archived, n, "archived rows counted as delivered")
	require.Zero(t, sum.ret.conflicts, "archive conflicts")
	require.Zero(t, sum.ret.duplicates, "archive duplicates (no message is archived twice)")
	require.Positive(t, sum.ret.archived, "retention archived nothing")
}

func loadLeases(t *testing.T, db *sql.DB, q string) map[lease]bool {
	t.Helper()
	out := map[lease]bool{}
	rs, err := db.Query(q)
	require.NoError(t, err)
	defer rs.Close()
	for rs.Next() {
		var lz lease
		require.NoError(t, rs.Scan(&lz.owner, &lz.id, &lz.token))
		out[lz] = true
	}
	require.NoError(t, rs.Err())
	return out
}
