package journal_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

func approvingJournal(t *testing.T, db *sql.DB, owner string, c *clock) *journal.Journal {
	t.Helper()
	j, err := journal.New(db, journal.Config{Owner: owner, BatchSize: 2, RequireApproval: true, Now: c.now})
	require.NoError(t, err)
	return j
}

// Issue 21: a dry run counted 3, 100 more rows were parked, and the same
// digest then purged 103. An approval binds the row set it saw: the rows
// parked after it are not touched, and a row that joins the set behind it
// (parked by a transaction that began before the approval and committed
// after) makes the execution refuse with the current count.
func TestApprovalBindsTheRowSetAndItsCount(t *testing.T) {
	s := newSchema(t)
	ctx := context.Background()
	// 'between' is pending at approval, with a seq inside the approved range.
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "between", Destination: "orders", Payload: []byte("x")})
	parked(t, s.DB, "old", 3, "EXHAUSTED", "orders", "", "", t0)
	c := newClock(t0.Add(time.Hour))
	j := approvingJournal(t, s.DB, "ops", c)
	f := journal.Filter{}

	_, err := j.Purge(ctx, "CHG-1", f, journal.Options{})
	require.ErrorIs(t, err, journal.ErrNotApproved, "no approval recorded: refused")
	require.Equal(t, 3, s.Count(t, "status = 'EXHAUSTED'"))

	a, err := j.Approve(ctx, "CHG-1", journal.OpPurge, f)
	require.NoError(t, err)
	require.EqualValues(t, 3, a.Count)
	require.Equal(t, testdb.QueryInt(t, s.DB, `SELECT max(seq)::int FROM messaging_outbox WHERE message_id LIKE 'old-%'`), int(a.MaxSeq))
	require.True(t, a.ParkedBefore.Equal(t0.Add(time.Hour)))
	_, err = j.Approve(ctx, "CHG-1", journal.OpPurge, f)
	require.ErrorIs(t, err, journal.ErrAlreadyApproved)

	// 100 rows parked after the approval are not part of it.
	parked(t, s.DB, "new", 100, "EXHAUSTED", "orders", "", "", t0.Add(2*time.Hour))
	// 'between' parked "before" the approval by a transaction that committed
	// after it: inside the row set, so the count passes the ceiling.
	_, err = s.DB.Exec(`UPDATE messaging_outbox SET status = 'EXHAUSTED', parked_at = $1, attempts = 1, last_failure_code = 'X'
	   WHERE message_id = 'between'`, t0)
	require.NoError(t, err)
	_, err = j.Purge(ctx, "CHG-1", f, journal.Options{})
	require.ErrorIs(t, err, journal.ErrApprovalExceeded)
	require.Contains(t, err.Error(), "4 rows match the approved row set now, 3 were approved")
	require.Equal(t, 104, s.Count(t, "status = 'EXHAUSTED'"), "refused before any row was touched")

	_, err = s.DB.Exec(`DELETE FROM messaging_outbox WHERE message_id = 'between'`)
	require.NoError(t, err)
	out, err := j.Purge(ctx, "CHG-1", f, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 3, out.Items)
	require.Zero(t, s.Count(t, "message_id LIKE 'old-%'"))
	require.Equal(t, 100, s.Count(t, "message_id LIKE 'new-%'"), "rows parked after the approval stay")
}

// The approval is bound to its plan: another filter under the ticket is
// refused, and the approver is the database login, whatever the client
// writes.
func TestApprovalIsTheLoginsAndBindsThePlan(t *testing.T) {
	s := newSchema(t)
	ctx := context.Background()
	parked(t, s.DB, "p", 2, "FAILED", "orders", "", "", t0)
	j := approvingJournal(t, s.DB, "ops", newClock(t0.Add(time.Hour)))
	_, err := j.Approve(ctx, "CHG-2", journal.OpRedrive, journal.Filter{Destination: "orders"})
	require.NoError(t, err)
	_, err = j.Redrive(ctx, "CHG-2", journal.Filter{}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrPlanMismatch)
	_, err = j.Purge(ctx, "CHG-2", journal.Filter{Destination: "orders"}, journal.Options{})
	require.ErrorIs(t, err, journal.ErrPlanMismatch, "a redrive approval does not purge")
	require.Equal(t, 2, s.Count(t, "status = 'FAILED'"))

	var login string
	require.NoError(t, s.DB.QueryRow(`SELECT session_user`).Scan(&login))
	a, err := j.FindApproval(ctx, "CHG-2")
	require.NoError(t, err)
	require.Equal(t, login, a.ApprovedBy)
	_, err = s.DB.Exec(`INSERT INTO messaging_admin_approval (approval_ticket, operation, plan_digest, plan, max_seq, parked_before, approved_count, approved_by)
	   VALUES ('CHG-3', 'purge', 'x', '{}', 1, now(), 1, 'the-cfo')`)
	require.NoError(t, err)
	forged, err := j.FindApproval(ctx, "CHG-3")
	require.NoError(t, err)
	require.Equal(t, login, forged.ApprovedBy, "approved_by is session_user, not what the client wrote")

	out, err := j.Redrive(ctx, "CHG-2", journal.Filter{Destination: "orders"}, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 2, out.Items)
	rec, err := j.Find(ctx, "CHG-2")
	require.NoError(t, err)
	require.Equal(t, []string{login}, rec.ExecutedBy, "the journal records the login that executed")
	require.Empty(t, rec.ForcedBy)
}

// Issue 21: `--owner <someone else's owner>` took over a live operation. A
// live operation resumes at once only for its owner under the login that
// ran it; another login naming the same owner is refused until the lease
// ends, unless it forces the takeover, which the journal records.
func TestTakeoverOfALiveOperationNeedsTheSameLoginOrForce(t *testing.T) {
	s := newSchema(t)
	ctx := context.Background()
	parked(t, s.DB, "p", 4, "EXHAUSTED", "orders", "", "", t0)
	c := newClock(t0.Add(time.Hour))
	alice := newJournal(t, s.DB, "ops-alice", c, 2)
	run, err := alice.Begin(ctx, "CHG-4", "purge", map[string]string{"x": "y"})
	require.NoError(t, err)
	require.False(t, run.TookOver)

	mallory, url := s.Role(t,
		`GRANT SELECT, INSERT, UPDATE ON messaging_admin_operation TO %[1]s`)
	mdb, err := testdb.OpenURL(url)
	require.NoError(t, err)
	defer mdb.Close()
	same := func(force bool) *journal.Journal {
		j, err := journal.New(mdb, journal.Config{Owner: "ops-alice", LeaseDuration: 30 * time.Second, Now: c.now, ForceTakeover: force})
		require.NoError(t, err)
		return j
	}
	_, err = same(false).Begin(ctx, "CHG-4", "purge", map[string]string{"x": "y"})
	require.ErrorIs(t, err, journal.ErrInFlight, "the owner's name is not enough under another login")

	again, err := alice.Begin(ctx, "CHG-4", "purge", map[string]string{"x": "y"})
	require.NoError(t, err, "the owner under its own login resumes at once")
	require.True(t, again.TookOver)

	forced, err := same(true).Begin(ctx, "CHG-4", "purge", map[string]string{"x": "y"})
	require.NoError(t, err)
	require.True(t, forced.TookOver)
	rec, err := alice.Find(ctx, "CHG-4")
	require.NoError(t, err)
	var login string
	require.NoError(t, s.DB.QueryRow(`SELECT session_user`).Scan(&login))
	require.Equal(t, []string{login, login, mallory}, rec.ExecutedBy)
	require.Equal(t, []string{mallory}, rec.ForcedBy, "the forced takeover is journaled with its login")
}
