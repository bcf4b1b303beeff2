package forwarder_test

import (
	"context"
	"slices"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// fencing.BlockKey's doc (issue 21): no later row of a key overtakes a
// parked one, but purging the parked row leaves a gap in what consumers see.
func TestBlockKeyHoldsTheKeyAndAPurgedHeadLeavesAGap(t *testing.T) {
	s := newDB(t)
	for _, id := range []string{"k1", "k2", "k3"} {
		m := message.NewMessage(id, []byte(id))
		envelope.SetOrderingKey(m, "k")
		insert(t, s.DB, "orders", m)
	}
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = 'FAILED', parked_at = now(), attempts = 1, last_failure_code = 'X' WHERE message_id = 'k1'`)
	require.NoError(t, err)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "gap"})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, rep.Published, "the parked head holds its key back")
	require.Empty(t, rec.ids())

	_, err = s.DB.Exec(`DELETE FROM messaging_outbox WHERE message_id = 'k1'`) // a purge
	require.NoError(t, err)
	for len(rec.ids()) < 2 {
		rep, err = f.RunOnce(context.Background())
		require.NoError(t, err)
		require.NotZero(t, rep.Claimed, "k2 and k3 are claimable once the head is gone")
	}
	require.Equal(t, []string{"k2", "k3"}, rec.ids(), "consumers see the key without k1: a gap")
}

// fencing.SkipParked (issue 14): a parked row does not hold back its key;
// the rows behind it go out in seq order, and the other keys are not held
// back under either policy.
func TestSkipParkedLetsAKeyPassItsParkedRow(t *testing.T) {
	for _, tc := range []struct {
		policy fencing.OrderingPolicy
		want   []string
	}{
		{fencing.BlockKey, []string{"o1", "o2"}},
		{fencing.SkipParked, []string{"k2", "k3", "o1", "o2"}},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			s := newDB(t)
			for _, r := range [][2]string{{"k1", "k"}, {"k2", "k"}, {"o1", "other"}, {"k3", "k"}, {"o2", "other"}} {
				m := message.NewMessage(r[0], []byte(r[0]))
				envelope.SetOrderingKey(m, r[1])
				insert(t, s.DB, "orders", m)
			}
			_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = 'EXHAUSTED', parked_at = now(), attempts = 3, last_failure_code = 'X' WHERE message_id = 'k1'`)
			require.NoError(t, err)
			rec := &recorder{}
			f := newForwarder(t, s.DB, rec, forwarder.Config{OrderingPolicy: tc.policy})
			for {
				rep, err := f.RunOnce(context.Background())
				require.NoError(t, err)
				if rep.Claimed == 0 {
					break
				}
			}
			got := rec.ids()
			require.ElementsMatch(t, tc.want, got)
			if tc.policy == fencing.SkipParked {
				require.Less(t, slices.Index(got, "k2"), slices.Index(got, "k3"), "seq order within the key")
			}
			require.Equal(t, "EXHAUSTED", state(t, s.DB, "k1").Status, "the parked row stays parked")
		})
	}
}
