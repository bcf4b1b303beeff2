package forwarder_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Regression (hostile review): 4 relays, BlockKey, keys whose rows alternate between two
// destinations; destination "a" flaps (down for 150 publish calls, up for
// 150, driven by the count of calls), random ambiguous failures on both
// (accepted-then-failed and lost-before-send), one hot key with 400 rows and
// 200 small keys. Guarantees: every committed row ends PUBLISHED (no EXHAUSTED
// from the outages: MaxAttempts is large but the flapping outlasts none of
// it), per key the first deliveries are in seq order across destinations.
func TestHostileFlappingDestinationInMixedChains(t *testing.T) {
	t.Parallel() // waits on leases, outages and processes: overlaps the other parallel tests
	if testing.Short() {
		t.Skip("about a minute of 4 relays")
	}
	s := newDB(t)
	s.DB.SetMaxOpenConns(24)
	s.DB.SetMaxIdleConns(24) // idle as many as open: no reconnect per statement (testdb.IdleConns)
	rows := make([]testdb.OutboxRow, 0, 1200)
	for g := 1; g <= 1200; g++ {
		dest, key := "b", "k"+strconv.Itoa(g%200)
		if g%2 == 0 {
			dest = "a"
		}
		switch {
		case g%3 == 0:
			key = "hot"
		case g%7 == 0:
			key = "" // NULL: unkeyed
		}
		rows = append(rows, testdb.Row(envelope.Row{MessageID: fmt.Sprintf("r%05d", g), Destination: dest, Payload: []byte{0}, OrderingKey: key}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	seqOf, keyOf := map[string]int64{}, map[string]string{}
	res, err := s.DB.Query(`SELECT message_id, seq, coalesce(ordering_key, '') FROM messaging_outbox`)
	require.NoError(t, err)
	for res.Next() {
		var id, key string
		var seq int64
		require.NoError(t, res.Scan(&id, &seq, &key))
		seqOf[id], keyOf[id] = seq, key
	}
	require.NoError(t, res.Err())

	var mu sync.Mutex
	calls := 0
	delivered := map[string]bool{}
	firsts := map[string][]int64{}
	rng := rand.New(rand.NewPCG(3, 5))
	out := &recorder{behave: func(topic string, m *message.Message) (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		calls++
		if topic == "a" && (calls/150)%2 == 1 {
			return false, errors.New("dial tcp 10.0.0.7:5672: connect: connection refused")
		}
		x := rng.IntN(100)
		if x < 4 {
			return false, errBroker
		}
		if !delivered[m.UUID] {
			delivered[m.UUID] = true
			if k := keyOf[m.UUID]; k != "" {
				firsts[k] = append(firsts[k], seqOf[m.UUID])
			}
		}
		if x < 8 {
			return true, errBroker
		}
		return true, nil
	}}
	cfg := outageConfig()
	cfg.MaxAttempts = 1000
	// Retries of the 8 % failed publishes back off from 1 ms (doubling to
	// 5 ms), not outageConfig's 10 to 60 ms: under BlockKey a key waits out
	// its head's backoff, so with the hot key's 400 rows the test spent most
	// of its time (34 s of it under -race) waiting on backoffs, not on the
	// outages it is about. Same rows, same failures, same checks.
	cfg.BackoffBase, cfg.BackoffMax = time.Millisecond, 5*time.Millisecond
	cfg.BatchSize, cfg.Concurrency = 50, 4
	cfg.OrderingPolicy = fencing.BlockKey
	rs := startRelays(t, s, out, 4, cfg)
	for {
		st := statusCounts(t, s)
		if st["PUBLISHED"]+st["EXHAUSTED"]+st["FAILED"] == 1200 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	rs.stop(t)
	st := statusCounts(t, s)
	require.Equal(t, 1200, st["PUBLISHED"], "statuses: %v", st)
	mu.Lock()
	defer mu.Unlock()
	for k, seqs := range firsts {
		for i := 1; i < len(seqs); i++ {
			require.Less(t, seqs[i-1], seqs[i], "key %s: first deliveries out of seq order: %v", k, seqs)
		}
	}
}

// Regression (hostile review): one keyed row whose publish is unavailable (MarkUnavailable: a
// partition without a leader, a subject whose stream is gone) while nothing
// else is claimable. The row goes back without an attempt (right), but the
// pass counted a chain, and Run re-polls at once after any pass with chains
// (forwarder.go, Run: "case ... cur.rep.Chains > 0"), also when every chain
// was cut: the relay claims and publishes the same row in a tight loop, with
// no poll interval and no backoff, hammering the broker and the database. A
// single message never opens the breaker, so nothing stops it. The unkeyed
// control waits its PollInterval between passes. Guarantee (issue 14): the
// idle backoff is for an empty or fully blocked outbox: a key whose only
// chain was put back is exactly that.
func TestHostileUnavailableKeyedRowSpinsWithoutPollInterval(t *testing.T) {
	t.Parallel() // waits on leases, outages and processes: overlaps the other parallel tests
	for _, key := range []string{"", "K"} {
		t.Run(fmt.Sprintf("key %q", key), func(t *testing.T) {
			s := newDB(t)
			insertKeyed(t, s.DB, "r1", key)
			var calls atomic.Int64
			rec := &recorder{behave: func(string, *message.Message) (bool, error) {
				calls.Add(1)
				return false, forwarder.MarkUnavailable(errors.New("kafka: LEADER_NOT_AVAILABLE for partition 3"))
			}}
			const poll = 100 * time.Millisecond
			// The row put back as unavailable is held off for
			// BreakerProbeBase (1 s by default) before it is claimable
			// again. With that default the passes between two claims find
			// nothing and wait their idle PollInterval anyway, so the test
			// took 30 s per case and a relay re-polling at once after the
			// put-back chain would not be seen. A hold-off far below the
			// poll leaves the PollInterval alone between the claims.
			f := newForwarder(t, s.DB, rec, forwarder.Config{PollInterval: poll, MaxPollInterval: poll, BreakerProbeBase: time.Millisecond})
			done := make(chan error, 1)
			start := time.Now()
			go func() { done <- f.Run(context.Background()) }()
			for calls.Load() < 30 {
				time.Sleep(time.Millisecond)
			}
			took := time.Since(start)
			require.NoError(t, f.Close())
			require.NoError(t, <-done)
			// A lower bound only: a slow machine makes this easier to meet.
			require.GreaterOrEqual(t, took, 29*poll, "30 publishes of the same put-back row in %s: less than one PollInterval (%s) between passes", took, poll)
		})
	}
}
