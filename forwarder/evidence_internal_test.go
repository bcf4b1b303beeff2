package forwarder

import (
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// confirm records one confirmed publish of message id to dest, as a pass
// that published it does (breakers.confirmed).
func confirm(b *breakers, dest, id string) {
	b.confirmed([]item{{
		claimed: &fencing.Claimed{Row: envelope.Row{MessageID: id, Destination: dest}},
		msg:     message.NewMessage(id, nil),
		outcome: fencing.Outcome{To: envelope.StatusPublished},
	}})
}

func newTestBreakers() *breakers {
	return &breakers{
		threshold: DefaultBreakerThreshold, base: time.Millisecond, max: 10 * time.Millisecond,
		jitter: func(base, _ time.Duration, _ int) time.Duration { return base },
		now:    time.Now,
	}
}

// The pass-wide rule's memory of excused messages: a failed set is outage
// evidence unless every message in it was excused with the same error
// before a later confirmed publish to the destination. The memory survives
// the breaker's closing (success), only a confirmed publish makes an excuse
// stale, and each destination has its own.
func TestExcusedMessagesAreEvidenceOnlyUntilTheDestinationConfirmsAnother(t *testing.T) {
	b := newTestBreakers()
	const text = "schema registry: incompatible schema"
	pair := []string{"p1", "p2"}

	require.True(t, b.passLikeOutage("orders", text, pair), "new messages failing alike: an outage")
	require.True(t, b.trip("orders", text))
	require.True(t, b.passLikeOutage("orders", text, pair), "no confirmed publish since: still an outage")
	require.True(t, b.success("orders"), "a probe that found nothing closes the breaker")
	require.True(t, b.passLikeOutage("orders", text, pair), "a closing without a confirmed publish makes no excuse stale")

	confirm(b, "orders", "good-1")
	require.True(t, b.trip("orders", text))
	require.True(t, b.success("orders"), "the confirmed publish closes the breaker, which forgets its probes")
	require.False(t, b.passLikeOutage("orders", text, pair),
		"excused before a later confirmed publish, failing alike: they fail on their own, the memory outlived the closing")
	require.False(t, b.passLikeOutage("orders", text, pair), "and stay so (not refreshed by a pass that is not evidence)")
	require.True(t, b.passLikeOutage("other", text, pair), "another destination's confirms make nothing stale here")

	require.True(t, b.passLikeOutage("orders", text, []string{"p1", "p2", "new"}),
		"one new message among them: an outage (that catches old ones too) puts them all back")
	require.True(t, b.passLikeOutage("orders", text, pair), "excused again, not stale until the next confirmed publish")
	confirm(b, "orders", "good-2")
	require.False(t, b.passLikeOutage("orders", text, pair))
	require.True(t, b.passLikeOutage("orders", "dial tcp: connection refused", pair), "another error: evidence")
	confirm(b, "orders", "good-3")
	require.False(t, b.passLikeOutage("orders", "dial tcp: connection refused", pair))

	confirm(b, "orders", "p1")
	require.NotContains(t, b.excused["orders"], "p1", "a confirmed message's excuse is forgotten")
	require.True(t, b.passLikeOutage("orders", "dial tcp: connection refused", pair), "p1 is new to the memory again")
}

// probeLikeOutage applies the same staleness: a probe of a message excused
// before a later confirmed publish is not evidence; a new one is, once per
// outage, and is then remembered as excused.
func TestProbeOfAStaleExcuseIsNotEvidence(t *testing.T) {
	b := newTestBreakers()
	const text = "schema registry: incompatible schema"
	require.True(t, b.passLikeOutage("orders", text, []string{"p1", "p2"}))
	confirm(b, "orders", "good")
	require.True(t, b.trip("orders", text))
	require.False(t, b.probeLikeOutage("orders", "p1", text), "excused before a later confirmed publish: the probe spends an attempt")
	require.True(t, b.probeLikeOutage("orders", "n1", text), "a new message probed failing like the outage: evidence")
	require.False(t, b.probeLikeOutage("orders", "n1", text), "probed again in the same outage: spends one")
	require.Contains(t, b.excused["orders"], "n1")

	confirm(b, "orders", "good-2")
	require.True(t, b.success("orders"))
	require.True(t, b.trip("orders", text))
	require.False(t, b.probeLikeOutage("orders", "n1", text), "the closing forgot the probes, not the excuse")
}

// The memory is bounded, all destinations together: past maxExcused ids it
// is dropped whole, which only makes the forgotten messages count as new
// again. A confirmed message's excuse leaves the count.
func TestExcusedMemoryIsBounded(t *testing.T) {
	b := newTestBreakers()
	count := func() int {
		n := 0
		for _, m := range b.excused {
			n += len(m)
		}
		require.Equal(t, b.nExcused, n, "the count follows the maps")
		return n
	}
	for i := range maxExcused + 10 {
		dest := []string{"orders", "billing"}[i%2]
		require.True(t, b.passLikeOutage(dest, "e", []string{"m" + strconv.Itoa(2*i), "m" + strconv.Itoa(2*i+1)}))
		require.LessOrEqual(t, count(), maxExcused)
	}
	confirm(b, "orders", "good")
	confirm(b, "billing", "good")
	last := []string{"m" + strconv.Itoa(2*(maxExcused+9)), "m" + strconv.Itoa(2*(maxExcused+9)+1)}
	require.False(t, b.passLikeOutage("billing", "e", last), "recent excuses are kept")
	require.True(t, b.passLikeOutage("orders", "e", []string{"m0", "m1"}), "dropped ones count as new")

	n := count()
	confirm(b, "billing", last[0])
	require.Equal(t, n-1, count())
	confirm(b, "billing", last[0])
	require.Equal(t, n-1, count(), "confirmed twice, counted once")
}
