package journal_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/leakcheck"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

var t0 = time.Date(2031, 5, 4, 12, 0, 0, 0, time.UTC)

// clock is a settable test clock shared by a replica's statements.
type clock struct{ at atomic.Int64 }

func newClock(at time.Time) *clock { c := &clock{}; c.set(at); return c }
func (c *clock) set(at time.Time)  { c.at.Store(at.UnixMicro()) }
func (c *clock) now() time.Time    { return time.UnixMicro(c.at.Load()).UTC() }

func newSchema(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(6)
	return s
}

func newJournal(t *testing.T, db *sql.DB, owner string, c *clock, batch int) *journal.Journal {
	t.Helper()
	cfg := journal.Config{Owner: owner, BatchSize: batch, LeaseDuration: 30 * time.Second}
	if c != nil {
		cfg.Now = c.now
	}
	j, err := journal.New(db, cfg)
	require.NoError(t, err)
	return j
}

// parked inserts n rows with the given status, destination, tenant and
// failure code, ids prefix-1..prefix-n, created (and parked or published,
// as the status requires) at `at`.
func parked(t *testing.T, db *sql.DB, prefix string, n int, status, dest, tenant, code string, at time.Time) {
	t.Helper()
	rows := make([]testdb.OutboxRow, 0, n)
	for g := 1; g <= n; g++ {
		r := envelope.Row{MessageID: prefix + "-" + strconv.Itoa(g), Destination: dest, Payload: []byte{1},
			Status: envelope.Status(status), Tenant: tenant, CreatedAt: at, Attempts: 10, LeaseOwner: "relay-x",
			LeaseToken: 7, LeaseExpiresAt: at, LastFailureCode: code, LastFailureDetail: "why", NextAttemptAt: at}
		if r.Status.Parked() {
			r.ParkedAt = at
		}
		if r.Status == envelope.StatusPublished {
			r.PublishedAt = at
		}
		rows = append(rows, testdb.Row(r))
	}
	testdb.InsertRows(t, db, rows...)
}

// logRedrives installs a trigger that records every parked -> PENDING
// transition, so a row redriven twice or never is visible.
func logRedrives(t *testing.T, db *sql.DB) {
	t.Helper()
	for _, q := range []string{
		`CREATE TABLE redrive_log (message_id text NOT NULL)`,
		`CREATE FUNCTION log_redrive() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO redrive_log VALUES (NEW.message_id); RETURN NEW; END $$`,
		`CREATE TRIGGER redrive_log AFTER UPDATE ON messaging_outbox FOR EACH ROW
WHEN (OLD.status IN ('FAILED', 'EXHAUSTED') AND NEW.status = 'PENDING') EXECUTE FUNCTION log_redrive()`,
	} {
		_, err := db.Exec(q)
		require.NoError(t, err)
	}
}

func TestConfigRefusals(t *testing.T) {
	_, err := journal.New(nil, journal.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.NoError(t, journal.Config{}.Validate())
	require.ErrorIs(t, journal.Config{LeaseDuration: 500 * time.Millisecond}.Validate(), outbox.ErrInvalidConfig)
	require.ErrorIs(t, journal.Config{LeaseDuration: -time.Second}.Validate(), outbox.ErrInvalidConfig)
	require.ErrorIs(t, journal.Config{BatchSize: -1}.Validate(), outbox.ErrInvalidConfig)
	_, err = journal.New(&sql.DB{}, journal.Config{BatchSize: -1})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)

	a, err := journal.New(&sql.DB{}, journal.Config{})
	require.NoError(t, err)
	b, err := journal.New(&sql.DB{}, journal.Config{})
	require.NoError(t, err)
	require.NotEqual(t, a.Owner(), b.Owner(), "default owners are unique per Journal")
}

func TestBadInputRefused(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	j := newJournal(t, s.DB, "a", nil, 10)
	ctx := context.Background()

	_, err := j.Begin(ctx, "", journal.OpRedrive, journal.Filter{})
	require.ErrorIs(t, err, journal.ErrTicketRequired)
	_, err = j.Begin(ctx, "T-1", "", journal.Filter{})
	require.ErrorIs(t, err, journal.ErrOperationRequired)
	_, err = j.Begin(ctx, "T-1", "x", func() {})
	require.Error(t, err, "a plan that is not JSON-encodable")
	_, err = j.Find(ctx, "")
	require.ErrorIs(t, err, journal.ErrTicketRequired)
	_, err = j.Find(ctx, "nope")
	require.ErrorIs(t, err, journal.ErrNotFound)
	_, err = j.Redrive(ctx, "", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrTicketRequired)
	_, err = j.Purge(ctx, "", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrTicketRequired)

	bad := map[string]journal.Filter{
		"non-parked status": {Statuses: []envelope.Status{envelope.StatusPending}},
		"published status":  {Statuses: []envelope.Status{envelope.StatusFailed, envelope.StatusPublished}},
		"empty message id":  {MessageIDs: []string{"a", ""}},
		"empty time range":  {CreatedAfter: t0, CreatedBefore: t0},
		"reversed range":    {CreatedAfter: t0, CreatedBefore: t0.Add(-time.Hour)},
	}
	for name, f := range bad {
		require.ErrorIs(t, f.Validate(), journal.ErrInvalidFilter, name)
		_, err := j.PlanRedrive(ctx, f)
		require.ErrorIs(t, err, journal.ErrInvalidFilter, name)
		_, err = j.Purge(ctx, "T-bad", f, journal.Options{})
		require.ErrorIs(t, err, journal.ErrInvalidFilter, name)
	}
	_, err = j.Find(ctx, "T-bad")
	require.ErrorIs(t, err, journal.ErrNotFound, "a refused filter leaves no journal row")
}

func TestDigest(t *testing.T) {
	base := journal.Filter{Destination: "orders", Statuses: []envelope.Status{envelope.StatusFailed, envelope.StatusExhausted},
		MessageIDs: []string{"b", "a"}, CreatedAfter: t0}
	d1, canon, err := journal.Digest(journal.OpRedrive, base)
	require.NoError(t, err)
	require.Len(t, d1, 64)
	require.JSONEq(t, `{"statuses":["EXHAUSTED","FAILED"],"destination":"orders","message_ids":["a","b"],"created_after":"2031-05-04T12:00:00Z"}`, string(canon))

	same := journal.Filter{Destination: "orders", Statuses: []envelope.Status{envelope.StatusExhausted, envelope.StatusFailed, envelope.StatusFailed},
		MessageIDs: []string{"a", "b", "a"}, CreatedAfter: t0.In(time.FixedZone("X", 3600))}
	d2, _, err := journal.Digest(journal.OpRedrive, same)
	require.NoError(t, err)
	require.Equal(t, d1, d2, "the same criteria written differently are the same plan")

	// The exact bytes: digests are compared across processes and builds, so
	// the encoding (zero times left out) does not depend on the toolchain.
	_, emptyCanon, err := journal.Digest(journal.OpRedrive, journal.Filter{})
	require.NoError(t, err)
	require.Equal(t, `{"statuses":["EXHAUSTED","FAILED"]}`, string(emptyCanon))
	require.Equal(t, `{"statuses":["EXHAUSTED","FAILED"],"destination":"orders","message_ids":["a","b"],"created_after":"2031-05-04T12:00:00Z"}`, string(canon))

	empty1, _, _ := journal.Digest(journal.OpRedrive, journal.Filter{})
	empty2, _, _ := journal.Digest(journal.OpRedrive, journal.Filter{Statuses: []envelope.Status{envelope.StatusFailed, envelope.StatusExhausted}})
	require.Equal(t, empty1, empty2, "no statuses means both parked statuses")

	for name, f := range map[string]journal.Filter{
		"destination": {Destination: "payments", Statuses: base.Statuses, MessageIDs: base.MessageIDs, CreatedAfter: t0},
		"statuses":    {Destination: "orders", Statuses: []envelope.Status{envelope.StatusFailed}, MessageIDs: base.MessageIDs, CreatedAfter: t0},
		"ids":         {Destination: "orders", Statuses: base.Statuses, MessageIDs: []string{"a"}, CreatedAfter: t0},
		"time":        {Destination: "orders", Statuses: base.Statuses, MessageIDs: base.MessageIDs, CreatedAfter: t0.Add(time.Microsecond)},
		"tenant":      {Destination: "orders", Statuses: base.Statuses, MessageIDs: base.MessageIDs, CreatedAfter: t0, Tenant: "acme"},
		"code":        {Destination: "orders", Statuses: base.Statuses, MessageIDs: base.MessageIDs, CreatedAfter: t0, FailureCode: "X"},
	} {
		d, _, err := journal.Digest(journal.OpRedrive, f)
		require.NoError(t, err)
		require.NotEqual(t, d1, d, name)
	}
	dp, _, err := journal.Digest(journal.OpPurge, base)
	require.NoError(t, err)
	require.NotEqual(t, d1, dp, "the operation is part of the digest")
}

func TestBeginConcurrentReplicasExactlyOneRuns(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	other := s.Open(t)
	other.SetMaxOpenConns(4)
	const replicas = 8
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		wins  atomic.Int32
		token atomic.Int64 // the winner's lease token, asserted on the test goroutine
		errs  = make(chan error, replicas)
	)
	for i := range replicas {
		db := s.DB
		if i%2 == 1 {
			db = other
		}
		j := newJournal(t, db, fmt.Sprintf("replica-%d", i), nil, 10)
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			run, err := j.Begin(context.Background(), "T-42", journal.OpRedrive, journal.Filter{Destination: "orders"})
			if err == nil {
				token.Store(run.LeaseToken)
				wins.Add(1)
				return
			}
			errs <- err
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	require.EqualValues(t, 1, wins.Load())
	require.EqualValues(t, 1, token.Load(), "the winner holds the first lease")
	n := 0
	for err := range errs {
		require.ErrorIs(t, err, journal.ErrInFlight)
		n++
	}
	require.Equal(t, replicas-1, n)
	require.Equal(t, 1, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_admin_operation`))
}

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

func TestStaleOwnerCheckpointRefusedAndItemsOnlyGrow(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	clk := newClock(t0)
	a := newJournal(t, s.DB, "a", clk, 10)
	b := newJournal(t, s.DB, "b", clk, 10)
	ctx := context.Background()

	runA, err := a.Begin(ctx, "T-1", "custom", map[string]int{"n": 1})
	require.NoError(t, err)
	require.NoError(t, a.Checkpoint(ctx, runA, 50, "c50"))
	require.NoError(t, a.Checkpoint(ctx, runA, 10, "c10"))
	rec, err := a.Find(ctx, "T-1")
	require.NoError(t, err)
	require.EqualValues(t, 50, rec.ItemsCompleted, "items_completed never goes backwards")
	require.Equal(t, "c10", rec.Checkpoint)
	require.True(t, rec.LeaseExpiresAt.Equal(t0.Add(30*time.Second)))

	// The checkpoint extended the lease: at t0+40s it has not expired...
	clk.set(t0.Add(20 * time.Second))
	require.NoError(t, a.Checkpoint(ctx, runA, 60, "c60"))
	clk.set(t0.Add(40 * time.Second))
	_, err = b.Begin(ctx, "T-1", "custom", map[string]int{"n": 1})
	require.ErrorIs(t, err, journal.ErrInFlight)

	// ...at t0+51s it has, and b takes over; a is fenced out.
	clk.set(t0.Add(51 * time.Second))
	runB, err := b.Begin(ctx, "T-1", "custom", map[string]int{"n": 1})
	require.NoError(t, err)
	require.True(t, runB.TookOver)
	require.EqualValues(t, 60, runB.ItemsCompleted)
	require.Equal(t, "c60", runB.Checkpoint)
	err = a.Checkpoint(ctx, runA, 70, "c70")
	require.ErrorIs(t, err, journal.ErrLeaseLost)
	require.Equal(t, journal.CodeLeaseLost, outbox.CodeOf(err))
	require.NoError(t, b.Checkpoint(ctx, runB, 70, "c70"))
	require.NoError(t, b.Complete(ctx, runB))
	require.ErrorIs(t, b.Checkpoint(ctx, runB, 80, "c80"), journal.ErrLeaseLost, "a completed operation takes no more checkpoints")
}

// Between Begin's read of an expired operation and its conditional UPDATE,
// another replica takes it over: the UPDATE itself refuses.
func TestTakeoverRaceRefusedByConditionalUpdate(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	clk := newClock(t0)
	ctx := context.Background()
	a := newJournal(t, s.DB, "a", clk, 10)
	_, err := a.Begin(ctx, "T-2", "custom", "plan")
	require.NoError(t, err)

	clk.set(t0.Add(time.Minute)) // a's lease expired
	b := newJournal(t, s.DB, "b", clk, 10)
	c := newJournal(t, s.DB, "c", clk, 10)
	var cRun *journal.Run
	journal.SetAfterRead(b, func() {
		var err error
		cRun, err = c.Begin(ctx, "T-2", "custom", "plan")
		require.NoError(t, err)
	})
	_, err = b.Begin(ctx, "T-2", "custom", "plan")
	require.ErrorIs(t, err, journal.ErrInFlight)
	require.NotNil(t, cRun)
	require.True(t, cRun.TookOver)
	rec, err := c.Find(ctx, "T-2")
	require.NoError(t, err)
	require.Equal(t, "c", rec.Owner)
	require.EqualValues(t, 2, rec.LeaseToken)
}

func TestFailedOperationIsTakenOverAtOnce(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	clk := newClock(t0)
	ctx := context.Background()
	a := newJournal(t, s.DB, "a", clk, 10)
	b := newJournal(t, s.DB, "b", clk, 10)
	run, err := a.Begin(ctx, "T-3", "custom", "plan")
	require.NoError(t, err)
	require.NoError(t, a.Checkpoint(ctx, run, 5, "c5"))
	require.NoError(t, a.Fail(ctx, run, "DOWNSTREAM", "broker gone"))
	rec, err := a.Find(ctx, "T-3")
	require.NoError(t, err)
	require.Equal(t, journal.StateFailed, rec.State)
	require.Equal(t, "DOWNSTREAM", rec.FailureCode)

	runB, err := b.Begin(ctx, "T-3", "custom", "plan")
	require.NoError(t, err)
	require.True(t, runB.TookOver)
	require.EqualValues(t, 5, runB.ItemsCompleted)
	rec, err = b.Find(ctx, "T-3")
	require.NoError(t, err)
	require.Equal(t, journal.StateStarted, rec.State)
	require.Empty(t, rec.FailureCode)
}

func TestTicketBoundToOnePlan(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	j := newJournal(t, s.DB, "a", nil, 10)
	ctx := context.Background()
	_, err := j.Begin(ctx, "T-5", journal.OpPurge, journal.Filter{Destination: "orders"})
	require.NoError(t, err)
	_, err = j.Begin(ctx, "T-5", journal.OpPurge, journal.Filter{Destination: "payments"})
	require.ErrorIs(t, err, journal.ErrPlanMismatch)
	_, err = j.Begin(ctx, "T-5", journal.OpRedrive, journal.Filter{Destination: "orders"})
	require.ErrorIs(t, err, journal.ErrPlanMismatch)
	// The same plan by the same owner resumes its own operation.
	run, err := j.Begin(ctx, "T-5", journal.OpPurge, journal.Filter{Destination: "orders"})
	require.NoError(t, err)
	require.True(t, run.TookOver)
	require.EqualValues(t, 2, run.LeaseToken)
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

// A checkpoint that is not a seq cursor (written by another tool through
// Checkpoint) cannot be resumed from; Redrive says so and marks the
// operation FAILED with the reason, instead of leaving it STARTED until its
// lease runs out with nothing in the journal to explain why.
func TestUnreadableCheckpointFailsTheOperation(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	parked(t, s.DB, "x", 3, "FAILED", "orders", "", "REJECTED", t0)
	clk := newClock(t0)
	a := newJournal(t, s.DB, "a", clk, 3)
	ctx := context.Background()
	run, err := a.Begin(ctx, "T-C", journal.OpRedrive, journal.Filter{})
	require.NoError(t, err)
	require.NoError(t, a.Checkpoint(ctx, run, 1, "page-2"))

	_, err = a.Redrive(ctx, "T-C", journal.Filter{}, journal.Options{})
	require.ErrorContains(t, err, `checkpoint "page-2" is not a seq cursor`)
	rec, err := a.Find(ctx, "T-C")
	require.NoError(t, err)
	require.Equal(t, journal.StateFailed, rec.State)
	require.Equal(t, string(journal.CodeBatchFailed), rec.FailureCode)
	require.Contains(t, rec.FailureDetail, "page-2")
	require.Equal(t, 3, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_outbox WHERE status = 'FAILED'`), "nothing redriven")
}
