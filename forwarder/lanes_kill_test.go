package forwarder_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The relay process of TestAMessageThatKillsItsRelayEndsExhausted is this
// test binary run again with laneChildEnv set. Its downstream kills the
// process (SIGKILL, no defer runs, nothing is written) when it is handed
// the poison message, and accepts every other one.
const laneChildEnv = "OUTBOX_TEST_LANE_CHILD_URL"

// runLaneChild is that relay process (TestMain calls it when laneChildEnv
// is set). It exits only by the poison message's SIGKILL, or with status 3.
func runLaneChild(url string) {
	db, err := testdb.OpenURL(url)
	if err != nil {
		os.Exit(3)
	}
	down := &recorder{behave: func(_ string, m *message.Message) (bool, error) {
		if m.UUID == "poison" {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal ends the process
		}
		return true, nil
	}}
	f, err := forwarder.New(db, down, nil, forwarder.Config{
		Fence: forwarder.FenceLanes, MaxAttempts: 3,
		LeaseDuration: 2 * time.Second, PublishTimeout: time.Second, HeartbeatInterval: 200 * time.Millisecond,
		PollInterval: 10 * time.Millisecond, MaxPollInterval: 50 * time.Millisecond,
	})
	if err != nil {
		os.Exit(3)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_ = f.Run(ctx) // the poison message ends the process before this returns
	os.Exit(3)
}

// A message whose publish kills the relay process, again and again, ends
// EXHAUSTED after its budget: each relay records what it holds on its lanes
// before it publishes, and the next one to take those lanes (after their
// lease expired) charges the rows nobody wrote an outcome for (every row
// of a batch that dies is charged, as an expired per-row lease is).
func TestAMessageThatKillsItsRelayEndsExhausted(t *testing.T) {
	t.Parallel() // waits on leases, outages and processes: overlaps the other parallel tests
	s := newDB(t)
	require.NoError(t, fencing.SetLaneCount(context.Background(), s.DB, 32, 3))
	insertKeyed(t, s.DB, "poison", "order-7")
	exe, err := os.Executable()
	require.NoError(t, err)
	// Each relay takes the lanes the last one left (once their lease
	// expired), charging the poison an attempt, and dies publishing it.
	for kill := range 3 {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), laneChildEnv+"="+s.URL)
		err := cmd.Run()
		var exit *exec.ExitError
		require.True(t, errors.As(err, &exit), "relay %d should have died: %v", kill+1, err)
		require.Equal(t, syscall.SIGKILL, exit.Sys().(syscall.WaitStatus).Signal(), "killed by its poison message")
		require.Equal(t, kill, state(t, s.DB, "poison").Attempts, "charged once per relay that died of it, by the next")
	}

	// The next relay takes the lanes and charges the third attempt (the
	// budget): the poison is parked, never handed to it. A row written
	// after it is delivered.
	insertKeyed(t, s.DB, "later", "order-8")
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "survivor", Fence: forwarder.FenceLanes, MaxAttempts: 3,
		LeaseDuration: 2 * time.Second, PublishTimeout: time.Second, PollInterval: 10 * time.Millisecond})
	await.Until(t, func() bool {
		_, err := f.RunOnce(context.Background())
		require.NoError(t, err)
		return state(t, s.DB, "later").Status == "PUBLISHED"
	}, "the expired lanes are taken and the later row is delivered")
	st := state(t, s.DB, "poison")
	require.Equal(t, "EXHAUSTED", st.Status)
	require.Equal(t, 3, st.Attempts)
	require.Equal(t, "LEASE_EXPIRED", st.Code)
	require.Equal(t, []string{"later"}, rec.ids(), "the poison never reached the survivor")
}

// Relays joining and leaving share the lanes without an operator: a relay
// that finds another live one gives back the lanes over its fair share once
// it holds nothing claimed there, the newcomer takes them, and the lanes of
// a relay that stops go to the one left.
func TestLaneRelaysRebalanceAsTheyJoinAndLeave(t *testing.T) {
	s := newDB(t)
	require.NoError(t, fencing.SetLaneCount(context.Background(), s.DB, 32, 25))
	owned := func(owner string) int { return forwarder.LanesOwned(t, s, owner) }
	start := func(owner string) (*forwarder.Forwarder, chan error) {
		f, err := forwarder.New(s.DB, &recorder{}, nil, forwarder.Config{Owner: owner, Fence: forwarder.FenceLanes,
			HeartbeatInterval: 100 * time.Millisecond, PollInterval: 20 * time.Millisecond, MaxPollInterval: 50 * time.Millisecond})
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- f.Run(context.Background()) }()
		return f, done
	}
	a, aDone := start("a")
	await.Until(t, func() bool { return owned("a") == 32 }, "alone, a takes every lane")
	b, bDone := start("b")
	await.Until(t, func() bool { return owned("a") == 16 && owned("b") == 16 }, "two live relays: 16 lanes each (a has %d, b %d)", owned("a"), owned("b"))
	require.NoError(t, b.Close())
	require.NoError(t, <-bDone)
	require.Equal(t, 0, owned("b"), "a stopping relay gives its lanes back")
	await.Until(t, func() bool { return owned("a") == 32 }, "a takes the lanes b gave back")
	require.NoError(t, a.Close())
	require.NoError(t, <-aDone)
}

// Relays follow the fleet between their renewals: with renewals an hour
// apart (HeartbeatInterval and LeaseDuration that long), a relay that joins
// still gets its share at once, while the first relay keeps claiming a
// backlog (it reads the fair share beside its claims, fencing.LaneShare,
// and gives back what it no longer holds), and the lanes of a relay that
// leaves go back to the one left. Before, the newcomer waited for the first
// relay's next renewal: a third of LeaseDuration, 10 s at the defaults,
// the whole of a 50,000-row drain.
func TestLaneRelaysFollowTheFleetBetweenRenewals(t *testing.T) {
	s := newDB(t)
	ctx := context.Background()
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 32, 25))
	owned := func(owner string) int { return forwarder.LanesOwned(t, s, owner) }
	// A backlog the relays work on throughout: each publish waits for the
	// test to let it through, one at a time.
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'm' || g, 'orders', '\x7b7d' FROM generate_series(1, 2000) g`)
	require.NoError(t, err)
	gate := make(chan struct{})
	defer close(gate)
	start := func(owner string) (*forwarder.Forwarder, chan error) {
		down := &recorder{behave: func(string, *message.Message) (bool, error) {
			<-gate
			return true, nil
		}}
		f, err := forwarder.New(s.DB, down, nil, forwarder.Config{Owner: owner, Fence: forwarder.FenceLanes,
			HeartbeatInterval: time.Hour, LeaseDuration: time.Hour, PublishTimeout: 30 * time.Second,
			BatchSize: 10, PollInterval: 20 * time.Millisecond, MaxPollInterval: 50 * time.Millisecond})
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- f.Run(ctx) }()
		t.Cleanup(func() { _ = f.Close() }) // after the gate closed (a deferred close runs first)
		return f, done
	}
	let := func() { // one publish through, if one waits
		select {
		case gate <- struct{}{}:
		default:
		}
	}
	a, aDone := start("a")
	await.Until(t, func() bool { return owned("a") == 32 }, "alone, a takes every lane")
	b, bDone := start("b")
	await.Until(t, func() bool { let(); return owned("a") == 16 && owned("b") == 16 },
		"a busy relay gives half its lanes to the one that joined (a has %d, b %d)", owned("a"), owned("b"))
	closed := make(chan error, 1)
	go func() { closed <- b.Close() }()
	for len(closed) == 0 { // b drains what it holds: its publishes go through
		select {
		case gate <- struct{}{}:
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.NoError(t, <-closed)
	require.NoError(t, <-bDone)
	require.Equal(t, 0, owned("b"), "a stopping relay gives its lanes back")
	await.Until(t, func() bool { let(); return owned("a") == 32 }, "a takes the lanes b gave back")
	go func() { closed <- a.Close() }()
	for len(closed) == 0 {
		select {
		case gate <- struct{}{}:
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.NoError(t, <-closed)
	require.NoError(t, <-aDone)
}
