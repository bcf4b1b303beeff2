package fencing_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

type leaseRecord struct {
	Status  string
	Owner   string
	Token   int64
	Expires sql.NullTime
}

func leaseOf(t *testing.T, db *sql.DB, id string) leaseRecord {
	t.Helper()
	var r leaseRecord
	var owner sql.NullString
	require.NoError(t, db.QueryRow(`SELECT status, lease_owner, lease_token, lease_expires_at FROM messaging_outbox WHERE message_id = $1`, id).
		Scan(&r.Status, &owner, &r.Token, &r.Expires))
	r.Owner = owner.String
	return r
}

// Package doc: terminal transitions clear lease_expires_at but keep
// lease_owner and lease_token as the record of the last holder. Shown for
// every outcome statement (the single-row Mark* helpers, the PUBLISHED-only
// fast path, the general batch) and for the row the claim parks itself.
func TestOutcomesClearTheExpiryButKeepTheLastHolder(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for _, id := range []string{"pub", "amb", "fail", "exh", "batch-pub", "batch-exh"} {
		insert(t, s.DB, id, "")
	}
	claimed, err := fencing.Claim(ctx, s.DB, params("holder", t0))
	require.NoError(t, err)
	require.Len(t, claimed, 6)
	leases := map[string]fencing.Lease{}
	for _, c := range claimed {
		require.True(t, c.Held())
		leases[c.Row.MessageID] = c.Lease
		rec := leaseOf(t, s.DB, c.Row.MessageID)
		require.True(t, rec.Expires.Valid, "a held row has an expiry")
		require.Equal(t, c.Lease.Token, rec.Token)
	}

	now := t0.Add(time.Second)
	for _, step := range []func() (fencing.Result, error){
		func() (fencing.Result, error) { return fencing.MarkPublished(ctx, s.DB, leases["pub"], now) },
		func() (fencing.Result, error) {
			return fencing.MarkAmbiguous(ctx, s.DB, leases["amb"], t0.Add(24*time.Hour), "E", "unknown", now)
		},
		func() (fencing.Result, error) {
			return fencing.MarkFailed(ctx, s.DB, leases["fail"], "R", "rejected", now)
		},
		func() (fencing.Result, error) {
			return fencing.MarkExhausted(ctx, s.DB, leases["exh"], "E", "spent", now)
		},
	} {
		res, err := step()
		require.NoError(t, err)
		require.Equal(t, fencing.Applied, res)
	}
	// A mixed batch goes through the general statement (not the
	// PUBLISHED-only one).
	res, err := fencing.Apply(ctx, s.DB, []fencing.Outcome{
		{Lease: leases["batch-pub"], To: envelope.StatusPublished, Now: now},
		{Lease: leases["batch-exh"], To: envelope.StatusExhausted, Code: "E", Now: now},
	})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied, fencing.Applied}, res)

	want := map[string]string{
		"pub": "PUBLISHED", "amb": "AMBIGUOUS", "fail": "FAILED", "exh": "EXHAUSTED",
		"batch-pub": "PUBLISHED", "batch-exh": "EXHAUSTED",
	}
	for id, status := range want {
		rec := leaseOf(t, s.DB, id)
		require.Equal(t, status, rec.Status, id)
		require.False(t, rec.Expires.Valid, "%s: lease_expires_at is cleared", id)
		require.Equal(t, "holder", rec.Owner, "%s: the last holder is kept", id)
		require.Equal(t, leases[id].Token, rec.Token, "%s: its token is kept", id)
	}

	// The claim parks rows itself. A budget lowered to 1 parks "amb" (its
	// one attempt is spent: BUDGET_SPENT); its last holder stays on record.
	insert(t, s.DB, "expired", "")
	p := params("lost", t0)
	p.MaxAttempts = 1
	lost, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"amb", "expired"}, ids(lost))
	require.False(t, lost[0].Held())
	require.Equal(t, fencing.CodeBudgetSpent, lost[0].Row.LastFailureCode)
	rec := leaseOf(t, s.DB, "amb")
	require.Equal(t, "EXHAUSTED", rec.Status)
	require.False(t, rec.Expires.Valid)
	require.Equal(t, leaseRecord{Status: "EXHAUSTED", Owner: "holder", Token: leases["amb"].Token}, rec)
	lost = lost[1:]
	require.True(t, lost[0].Held())

	// And a row whose expired lease spent the last attempt: the expiry is
	// cleared, the holder that lost it stays on record.
	p = params("next", t0.Add(time.Minute))
	p.MaxAttempts = 1
	parked, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"expired"}, ids(parked))
	require.False(t, parked[0].Held())
	rec = leaseOf(t, s.DB, "expired")
	require.Equal(t, "EXHAUSTED", rec.Status)
	require.False(t, rec.Expires.Valid, "lease_expires_at is cleared")
	require.Equal(t, "lost", rec.Owner, "the holder whose lease expired is kept")
	require.Equal(t, lost[0].Lease.Token, rec.Token)
}
