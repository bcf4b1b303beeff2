package forwarder_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
)

// An idle relay whose lanes are changing hands polls at most 250 ms apart
// (PollInterval when longer), not at its idle backoff: b joins while a
// holds every lane, claims nothing pass after pass, and still gets its
// share soon after a gives it back. With MaxPollInterval an hour, b's
// backoff before grew pass by pass (20 ms, 40 ms, ... an hour): its
// sixteenth pass came some eleven minutes after it joined, and a's lanes,
// and the rows in them, waited for its next one.
func TestAnIdleRelayKeepsPollingWhileItsLanesChangeHands(t *testing.T) {
	s := newDB(t)
	ctx := context.Background()
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 8, 25))
	owned := func(owner string) int { return forwarder.LanesOwned(t, s, owner) }
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'orders', '\x7b7d' FROM generate_series(1, 400) g`)
	require.NoError(t, err)
	gate := make(chan struct{}) // a's publishes, one at a time
	defer close(gate)
	cfg := forwarder.Config{Fence: forwarder.FenceLanes, HeartbeatInterval: time.Hour, LeaseDuration: time.Hour,
		PublishTimeout: 30 * time.Second, BatchSize: 10, PollInterval: 20 * time.Millisecond, MaxPollInterval: time.Hour}

	ac := cfg
	ac.Owner = "a"
	publishing := make(chan struct{})
	var once sync.Once
	a, err := forwarder.New(s.DB, &recorder{behave: func(string, *message.Message) (bool, error) {
		once.Do(func() { close(publishing) })
		<-gate
		return true, nil
	}}, nil, ac)
	require.NoError(t, err)
	aDone := startRun(ctx, a)
	// a is publishing, alone, with every lane: b joins a relay that is
	// busy (an idle one would give it its share at a's next pass).
	await.Until(t, func() bool {
		select {
		case <-publishing:
			return true
		default:
			return false
		}
	}, "a publishes its first batch")
	require.Equal(t, 8, owned("a"), "alone, a takes every lane")

	var idle atomic.Int64
	bc := cfg
	bc.Owner = "b"
	bc.OnReport = func(r forwarder.Report) {
		if r.Claimed == 0 {
			idle.Add(1)
		}
	}
	down := &recorder{}
	b, err := forwarder.New(s.DB, down, nil, bc)
	require.NoError(t, err)
	bDone := startRun(ctx, b)
	// a is stuck on its first publish: b claims nothing, pass after pass.
	await.Until(t, func() bool {
		select {
		case err := <-bDone:
			t.Fatalf("b stopped after %d idle passes: %v", idle.Load(), err)
		default:
		}
		return idle.Load() >= 16
	}, "b, short of its share, keeps polling")
	require.Zero(t, owned("b"), "a holds every lane while it publishes")

	let := func() {
		select {
		case gate <- struct{}{}:
		default:
		}
	}
	await.Until(t, func() bool { let(); return owned("a") == 4 && owned("b") == 4 },
		"a gives b its share once it holds nothing there (a has %d, b %d)", owned("a"), owned("b"))
	await.Until(t, func() bool { let(); return len(down.ids()) > 0 }, "b relays the rows of its lanes")

	closed := make(chan error, 2)
	go func() { closed <- a.Close() }()
	go func() { closed <- b.Close() }()
	for len(closed) < 2 { // a drains what it holds: its publishes go through
		select {
		case gate <- struct{}{}:
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.NoError(t, <-closed)
	require.NoError(t, <-closed)
	require.NoError(t, <-aDone)
	require.NoError(t, <-bDone)
}

// Idle relays follow the fleet between their renewals too: with renewals an
// hour apart, an idle relay gives a newcomer its share, and takes the lanes
// of a relay that left, at its next passes (it reads the fair share at most
// every PollInterval or 250 ms, the longer, while it is not draining full
// batches). Before, both
// waited for the next renewal, and a row written to a lane given back by a
// relay that stopped waited with them.
func TestIdleRelaysFollowTheFleetBetweenRenewals(t *testing.T) {
	s := newDB(t)
	ctx := context.Background()
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 8, 25))
	owned := func(owner string) int { return forwarder.LanesOwned(t, s, owner) }
	cfg := forwarder.Config{Fence: forwarder.FenceLanes, HeartbeatInterval: time.Hour, LeaseDuration: time.Hour,
		PollInterval: 20 * time.Millisecond, MaxPollInterval: 50 * time.Millisecond}
	start := func(owner string, down *recorder) (*forwarder.Forwarder, chan error) {
		c := cfg
		c.Owner = owner
		f, err := forwarder.New(s.DB, down, nil, c)
		require.NoError(t, err)
		t.Cleanup(func() { _ = f.Close() })
		return f, startRun(ctx, f)
	}
	aDown := &recorder{}
	a, aDone := start("a", aDown)
	await.Until(t, func() bool { return owned("a") == 8 }, "alone, a takes every lane")
	b, bDone := start("b", &recorder{})
	await.Until(t, func() bool { return owned("a") == 4 && owned("b") == 4 }, "idle a gives b its share")
	require.NoError(t, b.Close())
	require.NoError(t, <-bDone)
	require.Zero(t, owned("b"), "a stopping relay gives its lanes back")
	await.Until(t, func() bool { return owned("a") == 8 }, "idle a takes the lanes b gave back")

	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'orders', '\x7b7d' FROM generate_series(1, 300) g`) // rows in every lane
	require.NoError(t, err)
	await.Until(t, func() bool { return len(aDown.ids()) == 300 }, "a relays the rows of every lane")
	require.NoError(t, a.Close())
	require.NoError(t, <-aDone)
}
