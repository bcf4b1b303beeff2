package chaos_test

import (
	"context"
	"database/sql"
	"fmt"
	mrand "math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/journal"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

// The operator works beside the relays, over the fault window: retention
// in archive mode (a short horizon, so published rows move to
// messaging_outbox_archive while the relays run), and redrives and purges
// of parked rows through the journal, each under an approval recorded
// first (Journal.Approve), as outboxctl does with RequireApproval.
//
// Before a redrive it heals the downstream for about half of the
// rejection-fated rows it redrives (chaos_healed: the downstream accepts
// them from then on); the other redriven rows are rejected (or refused as
// corrupt) again and parked again. Every ticket is executed once: a second
// call with the same ticket must be refused (JOURNAL_ALREADY_EXECUTED).
type operator struct {
	t   *testing.T
	db  *sql.DB // outbox side
	ev  *sql.DB // evidence side (chaos_healed)
	j   *journal.Journal
	rng *mrand.Rand
	cfg soakConfig
	inj *injector

	mu       sync.Mutex
	redrives []opRecord
	purges   []opRecord
	purged   map[string]purgedRow
	healed   map[string]bool
	refused  int // second executions of a ticket, refused as they must be
	idle     int // ticks with no parked row to act on

	ret retentionTotals
}

type opRecord struct {
	ticket     string
	ids        []string
	start, end time.Time
}

type purgedRow struct {
	seq                  int64
	key, status, code    string
	fatedReject          bool
	purgeStart, purgeEnd time.Time
}

type retentionTotals struct {
	runs, skipped, batches          int
	archived, duplicates, conflicts int
}

func newOperator(t *testing.T, db, ev *sql.DB, cfg soakConfig, seed uint64, inj *injector) *operator {
	j, err := journal.New(db, journal.Config{Owner: "chaos-operator", RequireApproval: true, BatchSize: 3})
	if err != nil {
		t.Fatalf("journal.New: %v", err)
	}
	return &operator{t: t, db: db, ev: ev, j: j, rng: mrand.New(mrand.NewPCG(seed, 0x0e7a)), cfg: cfg, inj: inj,
		purged: map[string]purgedRow{}, healed: map[string]bool{}}
}

// run redrives and purges every cfg.opEvery over the window, then returns
// (its last redrive's rows are delivered while the soak settles).
func (o *operator) run(ctx context.Context, window time.Duration) {
	deadline := time.Now().Add(window)
	tick := time.NewTicker(o.cfg.opEvery)
	defer tick.Stop()
	n := 0
	for time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		n++
		o.inj.restartMu.RLock()
		if n%2 == 0 { // purges half as often: most parked rows are for redriving
			o.purge(ctx, n)
		}
		o.redrive(ctx, n)
		o.inj.restartMu.RUnlock()
	}
}

// retain runs retention (archive mode, horizon 1 s) every 700 ms until ctx
// ends, summing its results.
func (o *operator) retain(ctx context.Context) {
	c, err := retention.New(o.db, nil, retention.Config{Horizon: time.Second, AllowShortHorizons: true, Archive: true, BatchSize: 100})
	if err != nil {
		o.t.Errorf("retention.New: %v", err)
		return
	}
	tick := time.NewTicker(700 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		o.inj.restartMu.RLock()
		res, err := c.Run(ctx)
		o.inj.restartMu.RUnlock()
		if err != nil && ctx.Err() == nil {
			o.t.Errorf("retention run: %v", err)
			continue
		}
		// A run the soak's end cut short still counts the batches it
		// committed (its Result holds them): the archive has their rows.
		o.mu.Lock()
		o.ret.runs++
		if res.Skipped {
			o.ret.skipped++
		}
		o.ret.batches += res.Batches
		o.ret.archived += res.Archived
		o.ret.duplicates += res.ArchiveDuplicates
		o.ret.conflicts += res.ArchiveConflicts
		o.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
	}
}

type parkedCandidate struct {
	id, key, status, code string
	seq                   int64
	fatedReject           bool
}

// candidates returns up to n parked FAILED rows (rejected by the
// downstream, or refused as corrupt), picked at random, leaving out ids
// in skip.
func (o *operator) candidates(ctx context.Context, n int, skip map[string]bool) []parkedCandidate {
	rows, err := o.db.QueryContext(ctx, `SELECT message_id, seq, coalesce(ordering_key, ''), status, last_failure_code,
	        headers->>'chaos-fate' IS NOT NULL
	   FROM messaging_outbox
	  WHERE parked_at IS NOT NULL AND status = 'FAILED'
	    AND last_failure_code IN ('CHAOS_REJECTED', 'OUTBOX_CORRUPT_ROW', 'OUTBOX_RESERVED_HEADER')
	  ORDER BY seq`)
	if err != nil {
		o.t.Errorf("operator: list parked rows: %v", err)
		return nil
	}
	defer rows.Close()
	var all []parkedCandidate
	for rows.Next() {
		var c parkedCandidate
		if err := rows.Scan(&c.id, &c.seq, &c.key, &c.status, &c.code, &c.fatedReject); err != nil {
			o.t.Errorf("operator: scan: %v", err)
			return nil
		}
		if !skip[c.id] {
			all = append(all, c)
		}
	}
	if err := rows.Err(); err != nil {
		o.t.Errorf("operator: list parked rows: %v", err)
		return nil
	}
	o.rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	return all[:min(n, len(all))]
}

// execute plans, approves and runs op over exactly ids, then runs the
// ticket again, which must be refused; it reports the call's span.
func (o *operator) execute(ctx context.Context, op, ticket string, ids []string) (time.Time, time.Time, bool) {
	f := journal.Filter{Statuses: []envelope.Status{envelope.StatusFailed}, MessageIDs: ids}
	var plan journal.Plan
	var err error
	if op == journal.OpRedrive {
		plan, err = o.j.PlanRedrive(ctx, f)
	} else {
		plan, err = o.j.PlanPurge(ctx, f)
	}
	if err != nil {
		o.t.Errorf("operator: plan %s %s: %v", op, ticket, err)
		return time.Time{}, time.Time{}, false
	}
	if plan.Matching != int64(len(ids)) {
		o.t.Errorf("operator: plan %s %s matches %d rows, %d parked rows were picked", op, ticket, plan.Matching, len(ids))
	}
	a, err := o.j.Approve(ctx, ticket, op, f)
	if err != nil {
		o.t.Errorf("operator: approve %s %s: %v", op, ticket, err)
		return time.Time{}, time.Time{}, false
	}
	if a.Count != int64(len(ids)) {
		o.t.Errorf("operator: approval %s counts %d rows, want %d", ticket, a.Count, len(ids))
	}
	exec := o.j.Purge
	if op == journal.OpRedrive {
		exec = o.j.Redrive
	}
	start := time.Now()
	out, err := exec(ctx, ticket, f, journal.Options{})
	end := time.Now()
	if err != nil {
		o.t.Errorf("operator: %s %s: %v", op, ticket, err)
		return start, end, false
	}
	if out.Items != int64(len(ids)) {
		o.t.Errorf("operator: %s %s changed %d rows, %d were approved", op, ticket, out.Items, len(ids))
	}
	// A ticket runs once.
	again, err := exec(ctx, ticket, f, journal.Options{})
	if outbox.CodeOf(err) != journal.CodeAlreadyExecuted {
		o.t.Errorf("operator: %s %s executed a second time: items %d, err %v (want %s)", op, ticket, again.Items, err, journal.CodeAlreadyExecuted)
	} else {
		o.mu.Lock()
		o.refused++
		o.mu.Unlock()
	}
	return start, end, true
}

func (o *operator) redrive(ctx context.Context, n int) {
	picked := o.candidates(ctx, o.cfg.opRows, nil)
	if len(picked) == 0 {
		o.mu.Lock()
		o.idle++
		o.mu.Unlock()
		return
	}
	ids := make([]string, len(picked))
	var heal []string
	for i, c := range picked {
		ids[i] = c.id
		if c.code == "CHAOS_REJECTED" && o.rng.IntN(2) == 0 {
			heal = append(heal, c.id)
		}
	}
	// The downstream is fixed for these first, then they are redriven.
	if len(heal) > 0 {
		if _, err := o.ev.ExecContext(ctx, `INSERT INTO chaos_healed (message_id) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING`, pq.Array(heal)); err != nil {
			o.t.Errorf("operator: heal: %v", err)
			return
		}
		o.mu.Lock()
		for _, id := range heal {
			o.healed[id] = true
		}
		o.mu.Unlock()
	}
	ticket := fmt.Sprintf("chaos-redrive-%d", n)
	start, end, ok := o.execute(ctx, journal.OpRedrive, ticket, ids)
	if ok {
		o.mu.Lock()
		o.redrives = append(o.redrives, opRecord{ticket: ticket, ids: ids, start: start, end: end})
		o.mu.Unlock()
	}
}

func (o *operator) purge(ctx context.Context, n int) {
	o.mu.Lock()
	skip := map[string]bool{}
	for id := range o.healed {
		skip[id] = true
	}
	o.mu.Unlock()
	picked := o.candidates(ctx, max(1, o.cfg.opRows/2), skip)
	if len(picked) == 0 {
		o.mu.Lock()
		o.idle++
		o.mu.Unlock()
		return
	}
	ids := make([]string, len(picked))
	for i, c := range picked {
		ids[i] = c.id
	}
	ticket := fmt.Sprintf("chaos-purge-%d", n)
	start, end, ok := o.execute(ctx, journal.OpPurge, ticket, ids)
	if !ok {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.purges = append(o.purges, opRecord{ticket: ticket, ids: ids, start: start, end: end})
	for _, c := range picked {
		o.purged[c.id] = purgedRow{seq: c.seq, key: c.key, status: c.status, code: c.code, fatedReject: c.fatedReject,
			purgeStart: start, purgeEnd: end}
	}
}
