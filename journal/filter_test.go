package journal_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

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
