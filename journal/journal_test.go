package journal_test

import (
	"context"
	"database/sql"
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

// Config.Owner and Options.Progress promise that a Journal with the same Owner
// is the same replica: a process restarted under its owner name resumes its
// own interrupted operation at once (another owner waits out the lease the
// dead process left live), from the last committed checkpoint, under a new
// lease token that fences the interrupted process's run out. The restarted
// call's planned total is on the scale of its items: what was done before
// plus what is ahead of the checkpoint.
func TestSameOwnerResumesItsInterruptedOperation(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	logRedrives(t, s.DB)
	parked(t, s.DB, "x", 45, "EXHAUSTED", "orders", "", "TIMEOUT", t0.Add(-time.Hour))
	clk := newClock(t0)
	ctx := context.Background()

	// The first process stops after two batches (as a crash would), leaving
	// the operation STARTED with its lease live until t0+30s.
	first := newJournal(t, s.DB, "ops-1", clk, 10)
	out1, err := first.Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{Progress: func(p journal.Progress) error {
		if p.Batch == 2 {
			return errCrash
		}
		return nil
	}})
	require.ErrorIs(t, err, errCrash)
	require.EqualValues(t, 20, out1.Items)
	require.EqualValues(t, 45, out1.Plan.Matching)
	interrupted := out1.Run
	rec, err := first.Find(ctx, "T-SAME")
	require.NoError(t, err)
	require.Equal(t, journal.StateStarted, rec.State)
	require.Equal(t, "ops-1", rec.Owner)
	require.EqualValues(t, 1, rec.LeaseToken)
	require.EqualValues(t, 20, rec.ItemsCompleted)
	require.True(t, rec.LeaseExpiresAt.After(t0.Add(5*time.Second)))

	// A row the first process redrove is parked again before the restart:
	// it is behind the checkpoint, so the resume neither redoes nor counts it.
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'EXHAUSTED', attempts = 10, parked_at = $1 WHERE message_id = 'x-3'`, t0)
	require.NoError(t, err)

	clk.set(t0.Add(5 * time.Second)) // the lease is still live
	_, err = newJournal(t, s.Open(t), "ops-2", clk, 10).Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrInFlight, "another owner waits for the lease")

	// The restarted process: same owner name, its own connections.
	restarted := newJournal(t, s.Open(t), "ops-1", clk, 10)
	var seen []journal.Progress
	out2, err := restarted.Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{Progress: func(p journal.Progress) error {
		seen = append(seen, p)
		if p.Batch == 1 {
			// The interrupted process's run (token 1) no longer holds the
			// operation, although the owner name is the same.
			require.ErrorIs(t, first.Checkpoint(ctx, interrupted, 99, "1"), journal.ErrLeaseLost)
			require.ErrorIs(t, first.Fail(ctx, interrupted, "X", "y"), journal.ErrLeaseLost)
			require.ErrorIs(t, first.Complete(ctx, interrupted), journal.ErrLeaseLost)
		}
		return nil
	}})
	require.NoError(t, err)
	require.True(t, out2.Run.TookOver)
	require.Equal(t, "ops-1", out2.Run.Owner)
	require.EqualValues(t, 2, out2.Run.LeaseToken)
	require.Equal(t, 3, out2.Batches, "10 + 10 + 5 rows after the checkpoint")
	require.EqualValues(t, 45, out2.Items)
	require.EqualValues(t, 45, out2.Plan.Matching, "20 done before the restart + 25 ahead of the checkpoint (not x-3)")
	require.Len(t, seen, 3)
	for i, items := range []int64{30, 40, 45} {
		require.EqualValues(t, items, seen[i].Items)
		require.EqualValues(t, 45, seen[i].Planned, "batch %d", i+1)
	}

	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(DISTINCT message_id) FROM redrive_log`), "no row redriven twice")
	require.Equal(t, 44, s.Count(t, "status = 'PENDING' AND attempts = 0"))
	require.Equal(t, 1, s.Count(t, "message_id = 'x-3' AND status = 'EXHAUSTED' AND attempts = 10"))

	rec, err = restarted.Find(ctx, "T-SAME")
	require.NoError(t, err)
	require.Equal(t, journal.StateCompleted, rec.State)
	require.Equal(t, "ops-1", rec.Owner)
	require.EqualValues(t, 2, rec.LeaseToken)
	require.EqualValues(t, 45, rec.ItemsCompleted)

	// Resuming is not re-running: once completed, not even its owner runs it again.
	_, err = restarted.Redrive(ctx, "T-SAME", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrAlreadyExecuted)
}

// Package doc: an owner whose lease was taken over gets JOURNAL_LEASE_LOST
// and its batch rolls back. Replica A stalls after its first batch (in its
// Progress callback) past its lease; replica B takes the operation over; A's
// next batch is refused and changes nothing, B resumes after A's checkpoint,
// and no row is redriven twice or skipped.
func TestOwnerWhoseLeaseWasTakenOverGetsLeaseLost(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	logRedrives(t, s.DB)
	parked(t, s.DB, "x", 45, "EXHAUSTED", "orders", "", "TIMEOUT", t0.Add(-time.Hour))
	clkA, clkB := newClock(t0), newClock(t0)
	a := newJournal(t, s.DB, "a", clkA, 10)
	b := newJournal(t, s.Open(t), "b", clkB, 10)
	ctx := context.Background()

	var runB *journal.Run
	var batchesSeenByA int
	outA, err := a.Redrive(ctx, "T-LOST", journal.Filter{}, journal.Options{Progress: func(p journal.Progress) error {
		batchesSeenByA++
		if p.Batch != 1 {
			return nil
		}
		require.Equal(t, 10, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
		// A stalls past its lease (checkpointed at t0, 30s); B takes over.
		clkA.set(t0.Add(31 * time.Second))
		clkB.set(t0.Add(31 * time.Second))
		var err error
		runB, err = b.Begin(ctx, "T-LOST", journal.OpRedrive, journal.Filter{}.Normalize())
		require.NoError(t, err)
		require.True(t, runB.TookOver)
		require.EqualValues(t, 2, runB.LeaseToken)
		require.EqualValues(t, 10, runB.ItemsCompleted, "B starts from A's committed checkpoint")
		return nil
	}})
	require.ErrorIs(t, err, journal.ErrLeaseLost)
	require.Equal(t, journal.CodeLeaseLost, outbox.CodeOf(err))
	require.Equal(t, 1, batchesSeenByA, "A's second batch did not commit")
	require.Equal(t, 1, outA.Batches)
	require.EqualValues(t, 10, outA.Items)

	// A's refused batch changed nothing, and A did not mark B's operation
	// FAILED on its way out.
	require.Equal(t, 10, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 35, s.Count(t, "status = 'EXHAUSTED'"))
	rec, err := b.Find(ctx, "T-LOST")
	require.NoError(t, err)
	require.Equal(t, journal.StateStarted, rec.State)
	require.Equal(t, "b", rec.Owner)
	require.EqualValues(t, 2, rec.LeaseToken)
	require.EqualValues(t, 10, rec.ItemsCompleted)

	// B runs it to the end from A's checkpoint.
	outB, err := b.Redrive(ctx, "T-LOST", journal.Filter{}, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 45, outB.Items)
	require.Equal(t, 4, outB.Batches, "10 + 10 + 10 + 5 remaining rows")
	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM redrive_log`))
	require.Equal(t, 45, testdb.QueryInt(t, s.DB, `SELECT count(DISTINCT message_id) FROM redrive_log`), "no row redriven twice")
	require.Equal(t, 45, s.Count(t, "status = 'PENDING' AND attempts = 0"))
	rec, err = b.Find(ctx, "T-LOST")
	require.NoError(t, err)
	require.Equal(t, journal.StateCompleted, rec.State)
}
