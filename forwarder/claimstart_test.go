package forwarder_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// A row whose transaction commits after later rows were drained sits below
// where the relay's claims start while it drains full batches: it is not
// taken by the next claim, and it is taken by the rescan that comes at the
// latest 16 claims later (forwarder doc, "Where a claim starts"). Nothing
// is lost, nothing is published twice.
func TestALateCommitBelowTheClaimStartIsTakenByTheRescan(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	late := lateRow(t, s.DB)
	var ids []string
	for i := range 60 {
		ids = append(ids, fmt.Sprintf("m%02d", i))
	}
	insertN(t, s.DB, "orders", ids...)

	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{BatchSize: 2})
	for range 6 {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, rep.Published)
	}
	require.NoError(t, late.Commit())

	passes := 0
	for !slices.Contains(rec.ids(), "late") {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.NotZero(t, rep.Published, "the backlog is not drained yet")
		passes++
		require.LessOrEqual(t, passes, 16, "the rescan must come within 16 claims")
	}
	require.Greater(t, passes, 1, "the claim right after the commit started above the late row")
	for {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		if rep.Claimed == 0 {
			break
		}
	}
	got := rec.ids()
	require.Len(t, got, 61, "every row published once")
	require.ElementsMatch(t, append(ids, "late"), got)
	require.Equal(t, "PUBLISHED", state(t, s.DB, "late").Status)
}

// A key's next row never waits for the rescan: it comes after a row of one
// of the relay's last batches, and the claims start at or below those. Here
// one key's 20 rows come first and 20 unkeyed rows after them; every pass
// (2 rows) takes the key's next row and one unkeyed row, so the drain takes
// exactly 20 passes.
func TestAKeysNextRowDoesNotWaitForTheRescan(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insertKeyChain(t, s.DB, 20)
	for i := range 20 {
		insertN(t, s.DB, "orders", fmt.Sprintf("free-%02d", i))
	}
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{BatchSize: 2})
	for pass := range 20 {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, rep.Published, "pass %d", pass)
		require.Contains(t, rec.ids(), fmt.Sprintf("k-%02d", pass), "pass %d took the key's next row", pass)
	}
	require.Len(t, rec.ids(), 40)
}

// A claim that comes back short from its start point looks below it in the
// same pass: a short (here empty) batch never hides a claimable row, so a
// RunOnce that claims nothing means nothing was claimable, and Run only
// idles when that is so.
func TestAShortClaimLooksBelowItsStart(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	late := lateRow(t, s.DB)
	insertN(t, s.DB, "orders", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8")

	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{BatchSize: 2})
	for range 4 { // full batches: the claims now start above the first entry
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, rep.Published)
	}
	require.NoError(t, late.Commit())

	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published, "nothing was left above the start; the row below it was taken")
	require.Equal(t, "late", rec.ids()[8])
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Claimed)
}

// lateRow inserts the row "late" in a transaction it leaves open: the row
// takes the lowest seq and stays invisible until the caller commits.
func lateRow(t *testing.T, db *sql.DB) *sql.Tx {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	insertN(t, tx, "orders", "late")
	return tx
}

// Under Run, with prefetch and pipelining, a key's next row is claimable
// only once its predecessor's outcome commits, by which time the relay has
// claimed up to two more batches, past the key's rows: the start point
// bounds unkeyed rows only and keys are walked from their heads, so the
// key's rows keep coming every few passes and do not wait for the rescan. Here one key's 20 rows come first and 300
// unkeyed rows after them, in batches of 2: the key is done while at least
// 100 unkeyed rows are still to go. (Waiting for the rescan, 16 claims per
// key row, it would still be going when they run out.)
func TestUnderRunAKeysNextRowDoesNotWaitForTheRescan(t *testing.T) {
	s := newDB(t)
	insertKeyChain(t, s.DB, 20)
	for i := range 300 {
		insertN(t, s.DB, "orders", fmt.Sprintf("free-%03d", i))
	}
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{BatchSize: 2, PollInterval: 5 * time.Millisecond, MaxPollInterval: 10 * time.Millisecond})
	runUntilDelivered(t, f, rec, 320)

	got := rec.ids()
	last := slices.Index(got, "k-19")
	require.NotEqual(t, -1, last)
	require.Less(t, last, len(got)-100, "the key's last row went out at %d of %d", last, len(got))
}

// insertKeyChain inserts n rows k-00, k-01, ... of one ordering key.
func insertKeyChain(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	for i := range n {
		m := message.NewMessage(fmt.Sprintf("k-%02d", i), []byte("x"))
		envelope.SetOrderingKey(m, "key")
		insert(t, db, "orders", m)
	}
}

// A pass that gives rows back makes the next claim start at the first
// entry (forwarder doc, "Where a claim starts"): a row released without an
// attempt (here: not started before its start-by deadline, the clock having
// jumped during the publish before it) is taken by the very next claim,
// not 16 claims later, although the batch that released it was full.
func TestARowGivenBackIsTakenByTheNextClaim(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	var ids []string
	for i := range 40 {
		ids = append(ids, fmt.Sprintf("m%02d", i))
	}
	insertN(t, s.DB, "orders", ids...)

	clk := newClock()
	const lease, timeout = 30 * time.Second, 5 * time.Second
	rec := &recorder{behave: func(_ string, m *message.Message) (bool, error) {
		if m.UUID == "m06" {
			// Past the batch's start-by deadline (lease - 1.5 x timeout
			// after its claim), within its lease.
			clk.Advance(lease - timeout)
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{BatchSize: 2, Concurrency: 1, LeaseDuration: lease, PublishTimeout: timeout, Now: clk.Now})
	for range 3 { // full batches: the claims now start above the first entry
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, rep.Published)
	}
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, 1, rep.Released, "m07 was not started before its deadline")
	require.Equal(t, "PENDING", state(t, s.DB, "m07").Status)
	require.Zero(t, state(t, s.DB, "m07").Attempts)

	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, rep.Published)
	require.Equal(t, []string{"m07", "m08"}, rec.ids()[7:], "the next claim started at the first entry")
}
