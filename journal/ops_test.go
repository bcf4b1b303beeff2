package journal_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// Two replicas run the same approved redrive at the same time: one does the
// work, the other is refused, and every row is redriven exactly once.
func TestRedriveConcurrentReplicas(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	logRedrives(t, s.DB)
	parked(t, s.DB, "x", 120, "EXHAUSTED", "orders", "", "TIMEOUT", t0)
	other := s.Open(t)
	other.SetMaxOpenConns(4)
	a := newJournal(t, s.DB, "a", nil, 25)
	b := newJournal(t, other, "b", nil, 25)

	start := make(chan struct{})
	type res struct {
		out journal.Outcome
		err error
	}
	results := make(chan res, 2)
	for _, j := range []*journal.Journal{a, b} {
		go func() {
			<-start
			out, err := j.Redrive(context.Background(), "T-7", journal.Filter{}, journal.Options{})
			results <- res{out, err}
		}()
	}
	close(start)
	r1, r2 := <-results, <-results
	ok, refused := r1, r2
	if r1.err != nil {
		ok, refused = r2, r1
	}
	require.NoError(t, ok.err)
	require.EqualValues(t, 120, ok.out.Items)
	require.Error(t, refused.err)
	code := outbox.CodeOf(refused.err)
	require.Contains(t, []outbox.Code{journal.CodeInFlight, journal.CodeAlreadyExecuted}, code, refused.err.Error())

	require.Equal(t, 120, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 120, testdb.QueryInt(t, s.DB, `SELECT count(DISTINCT message_id) FROM redrive_log`))
	require.Equal(t, 120, s.Count(t, "status = 'PENDING' AND attempts = 0"))

	_, err := a.Redrive(context.Background(), "T-7", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrAlreadyExecuted)
	rec, err := a.Find(context.Background(), "T-7")
	require.NoError(t, err)
	require.Equal(t, journal.StateCompleted, rec.State)
	require.EqualValues(t, 120, rec.ItemsCompleted)
}

var errCrash = errors.New("simulated crash")

// A replica stops after two batches without completing (a crash); another
// replica is refused while the lease is live, takes over once it expired on
// the injected clock, resumes from the checkpoint, and the final state is
// exact: every row redriven once, none skipped, none redone.
func TestCrashResumesFromCheckpoint(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	logRedrives(t, s.DB)
	parked(t, s.DB, "x", 45, "EXHAUSTED", "orders", "", "TIMEOUT", t0.Add(-time.Hour))
	clkA, clkB := newClock(t0), newClock(t0)
	a := newJournal(t, s.DB, "a", clkA, 10)
	b := newJournal(t, s.Open(t), "b", clkB, 10)
	ctx := context.Background()

	var seen []journal.Progress
	_, err := a.Redrive(ctx, "T-9", journal.Filter{}, journal.Options{Progress: func(p journal.Progress) error {
		seen = append(seen, p)
		if p.Batch == 2 {
			return errCrash
		}
		return nil
	}})
	require.ErrorIs(t, err, errCrash)
	require.Len(t, seen, 2)
	require.EqualValues(t, 20, seen[1].Items)
	require.EqualValues(t, 45, seen[1].Planned)

	rec, err := a.Find(ctx, "T-9")
	require.NoError(t, err)
	require.Equal(t, journal.StateStarted, rec.State)
	require.EqualValues(t, 20, rec.ItemsCompleted)
	var seq20 string
	require.NoError(t, s.DB.QueryRow(`SELECT seq::text FROM messaging_outbox WHERE message_id = 'x-20'`).Scan(&seq20))
	require.Equal(t, seq20, rec.Checkpoint, "the checkpoint is the last committed row's seq")
	require.Equal(t, 20, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))

	// A relay fails a redriven row again before the resume: the resume must
	// not redo it (it is behind the cursor: that approval already acted).
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'EXHAUSTED', attempts = 10, parked_at = $1 WHERE message_id = 'x-3'`, t0)
	require.NoError(t, err)

	clkB.set(t0.Add(10 * time.Second))
	_, err = b.Redrive(ctx, "T-9", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrInFlight, "a's lease is live for 30s")

	clkB.set(t0.Add(31 * time.Second))
	out, err := b.Redrive(ctx, "T-9", journal.Filter{}, journal.Options{})
	require.NoError(t, err)
	require.True(t, out.Run.TookOver)
	require.EqualValues(t, 2, out.Run.LeaseToken)
	require.Equal(t, 3, out.Batches, "10 + 10 + 5 remaining rows")
	require.EqualValues(t, 45, out.Items)

	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(DISTINCT message_id) FROM redrive_log`), "no row redriven twice")
	require.Equal(t, 44, s.Count(t, "status = 'PENDING' AND attempts = 0"))
	require.Equal(t, 1, s.Count(t, "message_id = 'x-3' AND status = 'EXHAUSTED' AND attempts = 10"))

	// The stale owner is fenced out of every write.
	stale := &journal.Run{Ticket: "T-9", Digest: rec.Digest, Operation: journal.OpRedrive, Owner: "a", LeaseToken: 1}
	require.ErrorIs(t, a.Checkpoint(ctx, stale, 99, "1"), journal.ErrLeaseLost)
	require.ErrorIs(t, a.Complete(ctx, stale), journal.ErrLeaseLost)
	require.ErrorIs(t, a.Fail(ctx, stale, "X", "y"), journal.ErrLeaseLost)

	rec, err = a.Find(ctx, "T-9")
	require.NoError(t, err)
	require.Equal(t, journal.StateCompleted, rec.State)
	require.Equal(t, "b", rec.Owner)
	require.EqualValues(t, 45, rec.ItemsCompleted)
	require.True(t, rec.CompletedAt.Equal(t0.Add(31*time.Second)))

	clkA.set(t0.Add(time.Hour))
	_, err = a.Redrive(ctx, "T-9", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrAlreadyExecuted, "a completed operation never runs again")
}

// The dataset both filter tests use: parked rows that match and rows that
// differ in exactly one criterion, plus rows in every other status.
func filterDataset(t *testing.T, db *sql.DB) journal.Filter {
	t.Helper()
	in := t0.Add(-2 * time.Hour)
	parked(t, db, "match-exh", 7, "EXHAUSTED", "orders", "acme", "TIMEOUT", in)
	parked(t, db, "wrong-status", 3, "FAILED", "orders", "acme", "TIMEOUT", in)
	parked(t, db, "wrong-dest", 3, "EXHAUSTED", "payments", "acme", "TIMEOUT", in)
	parked(t, db, "wrong-tenant", 3, "EXHAUSTED", "orders", "other", "TIMEOUT", in)
	parked(t, db, "no-tenant", 3, "EXHAUSTED", "orders", "", "TIMEOUT", in)
	parked(t, db, "wrong-code", 3, "EXHAUSTED", "orders", "acme", "REJECTED", in)
	parked(t, db, "too-old", 3, "EXHAUSTED", "orders", "acme", "TIMEOUT", t0.Add(-48*time.Hour))
	parked(t, db, "too-new", 3, "EXHAUSTED", "orders", "acme", "TIMEOUT", t0)
	for _, st := range []string{"PENDING", "IN_FLIGHT", "AMBIGUOUS", "PUBLISHED"} {
		parked(t, db, "live-"+st, 2, st, "orders", "acme", "TIMEOUT", in)
	}
	return journal.Filter{
		Statuses: []envelope.Status{envelope.StatusExhausted}, Destination: "orders", Tenant: "acme",
		FailureCode: "TIMEOUT", CreatedAfter: t0.Add(-24 * time.Hour), CreatedBefore: t0.Add(-time.Hour),
	}
}

func TestRedriveTouchesOnlyMatchingParkedRows(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	f := filterDataset(t, s.DB)
	var before string
	require.NoError(t, s.DB.QueryRow(`SELECT jsonb_agg(to_jsonb(o) ORDER BY message_id)::text FROM messaging_outbox o WHERE message_id NOT LIKE 'match-%'`).Scan(&before))

	clk := newClock(t0)
	j := newJournal(t, s.DB, "a", clk, 3)
	ctx := context.Background()
	plan, err := j.PlanRedrive(ctx, f)
	require.NoError(t, err)
	require.EqualValues(t, 7, plan.Matching)
	require.Equal(t, 7, s.Count(t, "message_id LIKE 'match-%' AND status = 'EXHAUSTED'"), "the dry run changes nothing")
	_, err = j.Find(ctx, "T-R")
	require.ErrorIs(t, err, journal.ErrNotFound, "the dry run writes no journal row")

	var progress []int64
	out, err := j.Redrive(ctx, "T-R", f, journal.Options{Progress: func(p journal.Progress) error {
		progress = append(progress, p.Items)
		return nil
	}})
	require.NoError(t, err)
	require.Equal(t, plan.Digest, out.Plan.Digest)
	require.Equal(t, plan.Digest, out.Run.Digest)
	require.EqualValues(t, 7, out.Items)
	require.Equal(t, []int64{3, 6, 7}, progress)

	// Redriven rows: PENDING, budget reset, due now, lease cleared, token
	// kept, last failure kept.
	require.Equal(t, 7, testdb.QueryInt(t, s.DB, `
SELECT count(*) FROM messaging_outbox
 WHERE message_id LIKE 'match-%' AND status = 'PENDING' AND attempts = 0 AND next_attempt_at = $1
   AND parked_at IS NULL AND lease_owner IS NULL AND lease_expires_at IS NULL AND lease_token = 7
   AND last_failure_code = 'TIMEOUT' AND last_failure_detail = 'why'`, t0))

	var after string
	require.NoError(t, s.DB.QueryRow(`SELECT jsonb_agg(to_jsonb(o) ORDER BY message_id)::text FROM messaging_outbox o WHERE message_id NOT LIKE 'match-%'`).Scan(&after))
	require.JSONEq(t, before, after, "no other row changed in any column")

	rec, err := j.Find(ctx, "T-R")
	require.NoError(t, err)
	require.JSONEq(t, `{"statuses":["EXHAUSTED"],"destination":"orders","tenant":"acme","failure_code":"TIMEOUT",
"created_after":"2031-05-03T12:00:00Z","created_before":"2031-05-04T11:00:00Z"}`, string(rec.Plan))
}

func TestRedriveByMessageIDs(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	parked(t, s.DB, "f", 5, "FAILED", "orders", "", "REJECTED", t0)
	parked(t, s.DB, "e", 5, "EXHAUSTED", "orders", "", "TIMEOUT", t0)
	parked(t, s.DB, "p", 2, "PENDING", "orders", "", "", t0)
	j := newJournal(t, s.DB, "a", nil, 100)
	out, err := j.Redrive(context.Background(), "T-ids", journal.Filter{MessageIDs: []string{"f-1", "e-5", "p-1", "nope"}}, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 2, out.Items)
	require.Equal(t, 2, s.Count(t, "message_id IN ('f-1', 'e-5') AND status = 'PENDING'"))
	require.Equal(t, 8, s.Count(t, "status IN ('FAILED', 'EXHAUSTED')"))
}

func TestPurgeDeletesOnlyMatchingParkedRows(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	f := filterDataset(t, s.DB)
	total := s.Count(t, "")
	var before string
	require.NoError(t, s.DB.QueryRow(`SELECT jsonb_agg(to_jsonb(o) ORDER BY message_id)::text FROM messaging_outbox o WHERE message_id NOT LIKE 'match-%'`).Scan(&before))

	j := newJournal(t, s.DB, "a", nil, 2)
	ctx := context.Background()
	plan, err := j.PlanPurge(ctx, f)
	require.NoError(t, err)
	require.EqualValues(t, 7, plan.Matching)
	redrivePlan, err := j.PlanRedrive(ctx, f)
	require.NoError(t, err)
	require.NotEqual(t, plan.Digest, redrivePlan.Digest)

	out, err := j.Purge(ctx, "T-P", f, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 7, out.Items)
	require.Equal(t, 4, out.Batches, "2 + 2 + 2 + 1")
	require.Zero(t, s.Count(t, "message_id LIKE 'match-%'"))
	require.Equal(t, total-7, s.Count(t, ""))
	var after string
	require.NoError(t, s.DB.QueryRow(`SELECT jsonb_agg(to_jsonb(o) ORDER BY message_id)::text FROM messaging_outbox o`).Scan(&after))
	require.JSONEq(t, before, after)

	_, err = j.Purge(ctx, "T-P", f, journal.Options{})
	require.ErrorIs(t, err, journal.ErrAlreadyExecuted)
}

// A batch that fails (here: a trigger rejecting one row) rolls back, marks
// the operation FAILED with its checkpoint intact, and another replica resumes
// it at once, without waiting for the lease.
func TestFailedBatchReleasesOperation(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	logRedrives(t, s.DB)
	parked(t, s.DB, "x", 9, "FAILED", "orders", "", "REJECTED", t0)
	for _, q := range []string{
		`CREATE FUNCTION refuse_x7() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF NEW.message_id = 'x-7' THEN RAISE EXCEPTION 'x-7 is not welcome'; END IF; RETURN NEW; END $$`,
		`CREATE TRIGGER refuse_x7 BEFORE UPDATE ON messaging_outbox FOR EACH ROW EXECUTE FUNCTION refuse_x7()`,
	} {
		_, err := s.DB.Exec(q)
		require.NoError(t, err)
	}
	clk := newClock(t0)
	a := newJournal(t, s.DB, "a", clk, 3)
	b := newJournal(t, s.DB, "b", clk, 3)
	ctx := context.Background()

	out, err := a.Redrive(ctx, "T-F", journal.Filter{}, journal.Options{})
	require.ErrorContains(t, err, "x-7 is not welcome")
	require.Equal(t, 2, out.Batches)
	rec, err := a.Find(ctx, "T-F")
	require.NoError(t, err)
	require.Equal(t, journal.StateFailed, rec.State)
	require.Equal(t, string(journal.CodeBatchFailed), rec.FailureCode)
	require.Contains(t, rec.FailureDetail, "x-7 is not welcome")
	require.EqualValues(t, 6, rec.ItemsCompleted)
	require.Equal(t, 6, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`), "the failed batch rolled back")

	_, err = s.DB.Exec(`DROP TRIGGER refuse_x7 ON messaging_outbox`)
	require.NoError(t, err)
	out, err = b.Redrive(ctx, "T-F", journal.Filter{}, journal.Options{})
	require.NoError(t, err)
	require.True(t, out.Run.TookOver)
	require.EqualValues(t, 9, out.Items)
	require.Equal(t, 9, testdb.QueryInt(t, s.DB, `SELECT count(DISTINCT message_id) FROM redrive_log`))
	require.Equal(t, 9, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
}

// Redrive and purge batches find parked rows through a partial index and
// change them by primary key: no scan of the whole outbox per batch.
func TestBatchStatementsUseIndexes(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	_, err := s.DB.Exec(`
INSERT INTO messaging_outbox (message_id, destination, payload, status, published_at)
SELECT 'pub-' || g, 'orders', '\x01'::bytea, 'PUBLISHED', now() FROM generate_series(1, 20000) g`)
	require.NoError(t, err)
	parked(t, s.DB, "x", 50, "EXHAUSTED", "orders", "", "TIMEOUT", t0)
	_, err = s.DB.Exec(`ANALYZE messaging_outbox`)
	require.NoError(t, err)
	for _, f := range []journal.Filter{{}, {Destination: "orders"}} {
		for name, q := range journal.Statements {
			args := append(journal.FilterArgs(f), int64(0), 10)
			if name == "redrive" {
				args = append(args, t0)
			}
			plan := testdb.Explain(t, s.DB, q, args...)
			// The pick uses a partial index over unpublished rows (parked or
			// backlog, the planner's choice); the change goes by primary key.
			require.Regexp(t, `Index Scan using messaging_outbox_parked_idx`, plan, "%s plan:\n%s", name, plan)
			require.Contains(t, plan, "Index Scan using messaging_outbox_pkey", "%s plan:\n%s", name, plan)
			require.NotContains(t, plan, "Seq Scan", "%s plan:\n%s", name, plan)
		}
	}
}
