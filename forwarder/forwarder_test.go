package forwarder_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func TestDefaultsSatisfyTheirOwnRules(t *testing.T) {
	require.NoError(t, forwarder.Config{}.Validate())
	s := newDB(t)
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{})
	c := f.Config()
	require.Equal(t, 100, c.BatchSize)
	require.Equal(t, 30*time.Second, c.LeaseDuration)
	require.Equal(t, 5*time.Second, c.PublishTimeout)
	require.Equal(t, 500*time.Millisecond, c.PollInterval)
	require.Equal(t, 25, c.MaxAttempts)
	require.Equal(t, 10*time.Minute, c.BackoffMax)
	require.Equal(t, 5, c.BreakerThreshold)
	require.Equal(t, time.Second, c.BreakerProbeBase)
	require.Equal(t, 30*time.Second, c.BreakerProbeMax)
	require.Equal(t, 5*time.Second, c.MaxPollInterval)
	require.Equal(t, time.Second, c.BackoffBase)
	require.Equal(t, 8, c.Concurrency)
	require.Equal(t, 10*time.Second, c.HeartbeatInterval)
	require.Equal(t, c.PublishTimeout, c.DrainTimeout)
	require.Equal(t, int64(forwarder.DefaultMaxBatchBytes), c.MaxBatchBytes)
	require.Equal(t, forwarder.DefaultDBTimeout, c.DBTimeout)
	require.Equal(t, 2*c.Concurrency, c.MaxAbandoned)
	require.Equal(t, fencing.BlockKey, c.OrderingPolicy)
	require.Equal(t, publisher.DefaultNotifyChannel, c.NotifyChannel)
	require.NotNil(t, c.Classifier)
	// The exported constants are the values filled in.
	require.Equal(t, forwarder.DefaultMaxPollInterval, c.MaxPollInterval)
	require.Equal(t, forwarder.DefaultBackoffBase, c.BackoffBase)
	require.Equal(t, forwarder.DefaultConcurrency, c.Concurrency)
	require.Equal(t, forwarder.DefaultHeartbeatInterval, c.HeartbeatInterval)
	require.NoError(t, c.Validate(), "the filled-in config passes again")
	require.NotEmpty(t, f.Owner())

	// A default maximum is raised to its base when the base is set above it.
	r := newForwarder(t, s.DB, &recorder{}, forwarder.Config{PollInterval: 10 * time.Second, BackoffBase: time.Hour, BreakerProbeBase: time.Minute}).Config()
	require.Equal(t, 10*time.Second, r.MaxPollInterval)
	require.Equal(t, time.Hour, r.BackoffMax)
	require.Equal(t, time.Minute, r.BreakerProbeMax)

	g := newForwarder(t, s.DB, &recorder{}, forwarder.Config{})
	require.NotEqual(t, f.Owner(), g.Owner(), "default owners are unique per instance")
	require.Equal(t, f.Owner(), f.Config().Owner, "and stable for one instance")
}

func TestConfigRefusals(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg  forwarder.Config
		code outbox.Code
		hint string
	}{
		"lease too short":   {forwarder.Config{LeaseDuration: 9 * time.Second, PublishTimeout: 5 * time.Second}, outbox.CodeLeaseTooShort, "raise LeaseDuration"},
		"default lease":     {forwarder.Config{PublishTimeout: 20 * time.Second}, outbox.CodeLeaseTooShort, "lower PublishTimeout"},
		"negative batch":    {forwarder.Config{BatchSize: -1}, outbox.CodeInvalidConfig, "BatchSize"},
		"negative attempts": {forwarder.Config{MaxAttempts: -3}, outbox.CodeInvalidConfig, "MaxAttempts"},
		"negative poll":     {forwarder.Config{PollInterval: -time.Second}, outbox.CodeInvalidConfig, "PollInterval"},
		"negative conc":     {forwarder.Config{Concurrency: -1}, outbox.CodeInvalidConfig, "Concurrency"},
		"backoff max<base":  {forwarder.Config{BackoffBase: time.Minute, BackoffMax: time.Second}, outbox.CodeInvalidConfig, "raise BackoffMax"},
		"poll max<poll":     {forwarder.Config{PollInterval: time.Minute, MaxPollInterval: time.Second}, outbox.CodeInvalidConfig, "raise MaxPollInterval"},
		"drain too long":    {forwarder.Config{DrainTimeout: 26 * time.Second}, outbox.CodeInvalidConfig, "lower DrainTimeout"},
		"policy":            {forwarder.Config{OrderingPolicy: 9}, outbox.CodeInvalidConfig, "fencing.BlockKey"},
		"owner NUL":         {forwarder.Config{Owner: "a\x00b"}, outbox.CodeInvalidConfig, "Owner"},
		"channel too long":  {forwarder.Config{NotifyChannel: strings.Repeat("c", 64)}, outbox.CodeInvalidConfig, "NotifyChannel"},
		"db timeout":        {forwarder.Config{DBTimeout: 16 * time.Second}, outbox.CodeInvalidConfig, "lower DBTimeout or raise LeaseDuration"},
		"negative bytes":    {forwarder.Config{MaxBatchBytes: -1}, outbox.CodeInvalidConfig, "MaxBatchBytes"},
		"negative abandon":  {forwarder.Config{MaxAbandoned: -1}, outbox.CodeInvalidConfig, "MaxAbandoned"},
		"negative max size": {forwarder.Config{MaxBatchSize: -1}, outbox.CodeInvalidConfig, "MaxBatchSize"},
		"max below batch":   {forwarder.Config{BatchSize: 50, MaxBatchSize: 20}, outbox.CodeInvalidConfig, "MaxBatchSize 20 is below BatchSize 50"},
		"max below default": {forwarder.Config{MaxBatchSize: 20}, outbox.CodeInvalidConfig, "MaxBatchSize 20 is below BatchSize 100"},
		"huge batch":        {forwarder.Config{BatchSize: 1 << 40}, outbox.CodeInvalidConfig, "exceed 10000 rows"},
		"huge max batch":    {forwarder.Config{MaxBatchSize: forwarder.MaxClaimRows + 1}, outbox.CodeInvalidConfig, "use at most 10000"},
		"huge attempts":     {forwarder.Config{MaxAttempts: math.MaxInt32 + 1}, outbox.CodeInvalidConfig, "MaxAttempts 2147483648"},
		"owner not UTF-8":   {forwarder.Config{Owner: "relay\xff"}, outbox.CodeInvalidConfig, "Owner must be printable UTF-8"},
		"owner escape":      {forwarder.Config{Owner: "relay\x1b[31m"}, outbox.CodeInvalidConfig, "Owner must be printable UTF-8"},
		"owner too long":    {forwarder.Config{Owner: strings.Repeat("o", 201)}, outbox.CodeInvalidConfig, "Owner must be at most 200 bytes"},
		"producer newline":  {forwarder.Config{Producer: "svc\nforged"}, outbox.CodeInvalidConfig, "Producer must be printable UTF-8"},
		"producer not UTF8": {forwarder.Config{Producer: "\xfe"}, outbox.CodeInvalidConfig, "Producer"},
		"channel not UTF-8": {forwarder.Config{NotifyChannel: "ch\xff"}, outbox.CodeInvalidConfig, "NotifyChannel"},
		"channel NUL":       {forwarder.Config{NotifyChannel: "ch\x00"}, outbox.CodeInvalidConfig, "NotifyChannel"},
		"probe max<base":    {forwarder.Config{BreakerProbeBase: time.Minute, BreakerProbeMax: time.Second}, outbox.CodeInvalidConfig, "raise BreakerProbeMax"},
		"negative lease":    {forwarder.Config{LeaseDuration: -time.Second}, outbox.CodeInvalidConfig, "LeaseDuration must be positive"},
		"negative timeout":  {forwarder.Config{PublishTimeout: -time.Second}, outbox.CodeInvalidConfig, "PublishTimeout must be positive"},
		"negative beat":     {forwarder.Config{HeartbeatInterval: -time.Second}, outbox.CodeInvalidConfig, "HeartbeatInterval must be positive"},
		"negative drain":    {forwarder.Config{DrainTimeout: -time.Second}, outbox.CodeInvalidConfig, "DrainTimeout must be positive"},
		"negative breaker":  {forwarder.Config{BreakerThreshold: -1}, outbox.CodeInvalidConfig, "BreakerThreshold must be positive"},
		"negative probe":    {forwarder.Config{BreakerProbeBase: -time.Second}, outbox.CodeInvalidConfig, "BreakerProbeBase must be positive"},
		"negative probemax": {forwarder.Config{BreakerProbeMax: -time.Second}, outbox.CodeInvalidConfig, "BreakerProbeMax must be positive"},
		"negative dbtime":   {forwarder.Config{DBTimeout: -time.Second}, outbox.CodeInvalidConfig, "DBTimeout must be positive"},
		"negative backoff":  {forwarder.Config{BackoffBase: -time.Second}, outbox.CodeInvalidConfig, "BackoffBase must be positive"},
		"negative pollmax":  {forwarder.Config{MaxPollInterval: -time.Second}, outbox.CodeInvalidConfig, "MaxPollInterval must be positive"},
		// 2 x PublishTimeout must not overflow into an accepted lease or the wrong code.
		"lease 2x overflow": {forwarder.Config{PublishTimeout: 5e18, LeaseDuration: 6e18, DrainTimeout: time.Second}, outbox.CodeLeaseTooShort, "at least 2 x PublishTimeout or lower PublishTimeout"},
		"max timeout":       {forwarder.Config{PublishTimeout: math.MaxInt64}, outbox.CodeLeaseTooShort, "lower PublishTimeout"},
		"lease 2x minus 1":  {forwarder.Config{LeaseDuration: 2*time.Second - 1, PublishTimeout: time.Second, DrainTimeout: time.Millisecond}, outbox.CodeLeaseTooShort, "at least 2s"},
		// 3 x HeartbeatInterval (the heartbeat's lifetime) must not overflow in Run.
		"huge beat":       {forwarder.Config{HeartbeatInterval: math.MaxInt64 / 2}, outbox.CodeInvalidConfig, "HeartbeatInterval"},
		"beat over bound": {forwarder.Config{HeartbeatInterval: forwarder.MaxHeartbeatInterval + 1}, outbox.CodeInvalidConfig, "use at most 1h0m0s"},
		// 2 x Concurrency (the default MaxAbandoned) must not overflow either.
		"huge conc":     {forwarder.Config{Concurrency: math.MaxInt}, outbox.CodeInvalidConfig, "Concurrency 9223372036854775807 exceeds 10000"},
		"conc over max": {forwarder.Config{Concurrency: forwarder.MaxClaimRows + 1}, outbox.CodeInvalidConfig, "use at most 10000"},
	} {
		err := tc.cfg.Validate()
		require.Error(t, err, name)
		require.Equal(t, tc.code, outbox.CodeOf(err), name)
		require.Contains(t, err.Error(), tc.hint, name)
		_, err = forwarder.New(nil, nil, nil, tc.cfg)
		require.Error(t, err, name)
	}
	require.NoError(t, forwarder.Config{BatchSize: forwarder.MaxClaimRows}.Validate(), "the bound itself is allowed")
	require.NoError(t, forwarder.Config{Concurrency: forwarder.MaxClaimRows}.Validate(), "the bound itself is allowed")
	require.NoError(t, forwarder.Config{HeartbeatInterval: forwarder.MaxHeartbeatInterval}.Validate(), "the bound itself is allowed")
	require.NoError(t, forwarder.Config{LeaseDuration: 2 * time.Second, PublishTimeout: time.Second, DrainTimeout: time.Millisecond}.Validate(), "exactly 2 x PublishTimeout is enough")
	require.NoError(t, forwarder.Config{PublishTimeout: 4e18, LeaseDuration: 8e18, DrainTimeout: time.Second}.Validate(), "a huge lease of exactly 2 x PublishTimeout is enough")
	require.NoError(t, forwarder.Config{Owner: "relay-é-1", Producer: "billing/ν2"}.Validate(), "printable UTF-8 is fine")
	s := newDB(t)
	_, err := forwarder.New(nil, &recorder{}, nil, forwarder.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = forwarder.New(s.DB, nil, nil, forwarder.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = forwarder.New(s.DB, &recorder{}, nil, forwarder.Config{LeaseDuration: time.Second, PublishTimeout: time.Second})
	require.ErrorIs(t, err, outbox.ErrLeaseTooShort)
	// A short lease gets a DBTimeout of half of it by default.
	c := forwarder.Config{LeaseDuration: 4 * time.Second, PublishTimeout: time.Second}
	require.NoError(t, c.Validate())
	f := newForwarder(t, s.DB, &recorder{}, c)
	require.Equal(t, 2*time.Second, f.Config().DBTimeout)
}

func TestRetryDelayJitterIsPerOwnerAndDeterministic(t *testing.T) {
	s := newDB(t)
	cfg := forwarder.Config{BackoffBase: time.Second, BackoffMax: time.Minute}
	cfg.Owner = "relay-a"
	a1 := newForwarder(t, s.DB, &recorder{}, cfg)
	a2 := newForwarder(t, s.DB, &recorder{}, cfg)
	cfg.Owner = "relay-b"
	b := newForwarder(t, s.DB, &recorder{}, cfg)

	differs := 0
	for attempt := 1; attempt <= 10; attempt++ {
		full := min(time.Second<<(attempt-1), time.Minute)
		da := a1.RetryDelay("m1", attempt)
		require.Equal(t, da, a2.RetryDelay("m1", attempt), "same owner, same delay")
		require.GreaterOrEqual(t, da, full/2)
		require.LessOrEqual(t, da, full)
		if da != b.RetryDelay("m1", attempt) {
			differs++
		}
	}
	require.GreaterOrEqual(t, differs, 9, "another relay spreads its retries differently")
	require.NotEqual(t, a1.RetryDelay("m1", 3), a1.RetryDelay("m2", 3), "and different messages spread too")
}

// Run with the statements prepared (the default) and plain: the outcomes are
// the same.
func TestOutcomesAreWrittenFenced(t *testing.T) {
	for _, plain := range []bool{false, true} {
		t.Run(fmt.Sprintf("DisablePreparedStatements=%v", plain), func(t *testing.T) { outcomesAreWrittenFenced(t, plain) })
	}
}

func outcomesAreWrittenFenced(t *testing.T, plain bool) {
	ctx := context.Background()
	s := newDB(t)
	clk := newClock()
	insertN(t, s.DB, "orders", "ok", "rejected", "broken", "custom")
	rec := &recorder{behave: func(_ string, m *message.Message) (bool, error) {
		switch m.UUID {
		case "rejected":
			return false, forwarder.Reject(errors.New("schema violation"), "SCHEMA_INVALID")
		case "broken":
			return false, errBroker
		case "custom":
			return false, errors.New("quota")
		}
		return true, nil
	}}
	var reports []forwarder.Report
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		Owner: "relay-1", Now: clk.Now, BackoffBase: time.Second, BackoffMax: time.Minute,
		DisablePreparedStatements: plain,
		OnReport:                  func(r forwarder.Report) { reports = append(reports, r) },
		Classifier: func(err error) forwarder.Verdict {
			if err.Error() == "quota" {
				return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: "QUOTA"}
			}
			return forwarder.DefaultClassifier(err)
		},
	})
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 4, rep.Claimed)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, 1, rep.Failed)
	require.Equal(t, 2, rep.Ambiguous)
	require.Zero(t, rep.Stale+rep.Exhausted+rep.Released)
	require.Len(t, reports, 1)

	require.Equal(t, "PUBLISHED", state(t, s.DB, "ok").Status)
	rj := state(t, s.DB, "rejected")
	require.Equal(t, "FAILED", rj.Status)
	require.Equal(t, "SCHEMA_INVALID", rj.Code)
	require.True(t, rj.Parked.Valid)
	br := state(t, s.DB, "broken")
	require.Equal(t, "AMBIGUOUS", br.Status)
	require.Equal(t, forwarder.FailurePublishError, br.Code)
	require.Equal(t, 1, br.Attempts)
	require.WithinDuration(t, t0.Add(f.RetryDelay("broken", 1)), br.Next.Time, time.Microsecond, "PostgreSQL keeps microseconds")
	require.Equal(t, "QUOTA", state(t, s.DB, "custom").Code)
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"))

	// Not due yet: nothing is claimed.
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Claimed)

	// Due: the same message id is tried again.
	clk.Advance(time.Minute)
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, rep.Claimed)
	require.Equal(t, 2, state(t, s.DB, "broken").Attempts)
}

func TestBudgetSpentParksExhausted(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	clk := newClock()
	insertN(t, s.DB, "orders", "m1")
	rec := &recorder{behave: func(string, *message.Message) (bool, error) { return true, errBroker }}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: clk.Now, MaxAttempts: 3})
	for range 2 {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, rep.Ambiguous)
		clk.Advance(time.Hour)
	}
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Exhausted, "the third attempt is the last: attempts+1 = max")
	st := state(t, s.DB, "m1")
	require.Equal(t, "EXHAUSTED", st.Status)
	require.Equal(t, 3, st.Attempts)
	require.Equal(t, forwarder.FailurePublishError, st.Code)
	require.True(t, st.Parked.Valid)
	require.Equal(t, []string{"m1", "m1", "m1"}, rec.ids(), "retried under the same message id")

	clk.Advance(24 * time.Hour)
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Claimed)
}

func TestHangingPublishIsAmbiguousWhileTheLeaseHolds(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	h := newHanger(t)
	f := newForwarder(t, s.DB, h, forwarder.Config{
		PublishTimeout: 50 * time.Millisecond, LeaseDuration: 10 * time.Second, DrainTimeout: time.Second,
	})
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, "m1", <-h.entered)
	require.Equal(t, 1, rep.Ambiguous)
	require.Zero(t, rep.Stale, "the outcome was written under a live lease")
	require.Less(t, rep.Duration, 10*time.Second)
	st := state(t, s.DB, "m1")
	require.Equal(t, "AMBIGUOUS", st.Status)
	require.Equal(t, forwarder.FailurePublishTimeout, st.Code)
}

// TestAPublishLeftBehindDoesNotHoldUpTheRest: with one publish at a time, a
// publish that overruns PublishTimeout is left running and the worker goes
// on with the next rows; the goroutine left behind ends once the publish
// returns (goleak, in TestMain).
func TestAPublishLeftBehindDoesNotHoldUpTheRest(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2", "m3")
	release := make(chan struct{})
	returned := make(chan struct{})
	rec := &recorder{behave: func(_ string, m *message.Message) (bool, error) {
		if m.UUID == "m1" {
			<-release
			close(returned)
			return false, nil
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		Concurrency: 1, PublishTimeout: 50 * time.Millisecond, LeaseDuration: 10 * time.Second, DrainTimeout: time.Second,
	})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Ambiguous)
	require.Equal(t, 2, rep.Published)
	require.Equal(t, []string{"m2", "m3"}, rec.ids(), "published while m1's publish still ran")
	require.Equal(t, forwarder.FailurePublishTimeout, state(t, s.DB, "m1").Code)
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m3").Status)
	close(release)
	<-returned
}

func TestPanickingPublisherIsAmbiguous(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	f := newForwarder(t, s.DB, panicker{}, forwarder.Config{})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Ambiguous)
	require.Equal(t, forwarder.FailurePublishPanic, state(t, s.DB, "m1").Code)
}

func TestErrorAfterDeliveringIsRetriedUnderTheSameID(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	clk := newClock()
	insertN(t, s.DB, "orders", "m1")
	var calls int
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		calls++
		if calls == 1 {
			return true, errBroker // delivered, but the ack was lost
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: clk.Now})
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Ambiguous)
	clk.Advance(time.Hour)
	rep, err = f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, []string{"m1", "m1"}, rec.ids(), "at least once: a duplicate with the same id, never a new id")
}

func TestUnknownOutcomeFailsLoudlyAndLeavesNothingInFlight(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	rec := &recorder{behave: func(string, *message.Message) (bool, error) { return false, errBroker }}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		Classifier: func(error) forwarder.Verdict { return forwarder.Verdict{Outcome: 42} },
	})
	_, err := f.RunOnce(context.Background())
	require.ErrorIs(t, err, forwarder.ErrUnknownOutcome)
	st := state(t, s.DB, "m1")
	require.Equal(t, "AMBIGUOUS", st.Status)
	require.Equal(t, forwarder.FailureUnknownOutcome, st.Code)
}

func TestRowsThatCannotBecomeMessagesAreParkedFailed(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES
		('reserved', 'd', '', '{"msg.tenant": "x"}'), ('corrupt', 'd', '', '{"n": 1}'), ('fine', 'd', '', '{}')`)
	require.NoError(t, err)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, rep.Failed)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, []string{"fine"}, rec.ids())
	require.Equal(t, string(outbox.CodeReservedHeader), state(t, s.DB, "reserved").Code)
	require.Equal(t, string(outbox.CodeCorruptRow), state(t, s.DB, "corrupt").Code)
	require.Equal(t, "FAILED", state(t, s.DB, "corrupt").Status)
}

func TestSupersededRelayIsReportedStale(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	clk := newClock()
	insertN(t, s.DB, "orders", "m1")
	recB := &recorder{}
	fB := newForwarder(t, s.DB, recB, forwarder.Config{Owner: "relay-b", Now: clk.Now})
	var repB forwarder.Report
	// Relay A's publish stalls past its lease (a GC pause, a partition);
	// meanwhile relay B reclaims the row and publishes it.
	recA := &recorder{behave: func(string, *message.Message) (bool, error) {
		clk.Advance(31 * time.Second)
		var err error
		repB, err = fB.RunOnce(ctx)
		require.NoError(t, err)
		return true, nil
	}}
	fA := newForwarder(t, s.DB, recA, forwarder.Config{Owner: "relay-a", Now: clk.Now})
	repA, err := fA.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, repB.Published)
	require.Equal(t, 1, repA.Stale)
	require.Zero(t, repA.Published)
	st := state(t, s.DB, "m1")
	require.Equal(t, "PUBLISHED", st.Status)
	require.Equal(t, "relay-b", st.Owner)
	require.Equal(t, 2, st.Attempts, "A's lost attempt was counted by B's reclaim")
}

func TestOrderingAcrossFourRelaysWithRandomFailures(t *testing.T) {
	s := newDB(t)
	const keys, perKey, unkeyed = 4, 12, 12
	for i := range perKey {
		for k := range keys {
			m := message.NewMessage(fmt.Sprintf("k%d-%02d", k, i), nil)
			envelope.SetOrderingKey(m, fmt.Sprintf("key-%d", k))
			insert(t, s.DB, "orders", m)
		}
		if i < unkeyed {
			insertN(t, s.DB, "orders", fmt.Sprintf("u-%02d", i))
		}
	}
	clk := newClock()
	clk.step = time.Millisecond // every reading moves time on: retries become due without sleeping
	var mu sync.Mutex
	var arrived []string
	rng := rand.New(rand.NewPCG(1, 2))
	out := &recorder{behave: func(_ string, m *message.Message) (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		switch rng.IntN(4) {
		case 0:
			return false, errBroker // lost before the broker
		case 1:
			arrived = append(arrived, m.UUID)
			return true, errBroker // delivered, ack lost
		}
		arrived = append(arrived, m.UUID)
		return true, nil
	}}
	var wg sync.WaitGroup
	for r := range 4 {
		db := s.Open(t)
		db.SetMaxOpenConns(2)
		f := newForwarder(t, db, out, forwarder.Config{
			Owner: fmt.Sprintf("relay-%d", r), Now: clk.Now, BatchSize: 5, Concurrency: 3,
			BackoffBase: time.Millisecond, BackoffMax: 5 * time.Millisecond, MaxAttempts: 1000,
		})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 2000 {
				if _, err := f.RunOnce(context.Background()); err != nil {
					t.Errorf("pass: %v", err)
					return
				}
				var left int
				if err := db.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE status <> 'PUBLISHED'`).Scan(&left); err != nil {
					t.Errorf("count: %v", err)
					return
				}
				if left == 0 {
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Zero(t, s.Count(t, "status <> 'PUBLISHED'"))
	last := map[string]int{}
	seen := map[string]bool{}
	for _, id := range arrived {
		seen[id] = true
		if !strings.HasPrefix(id, "k") {
			continue
		}
		key := id[:2]
		var n int
		_, err := fmt.Sscanf(id[3:], "%d", &n)
		require.NoError(t, err)
		require.GreaterOrEqual(t, n, last[key], "key %s: %s arrived after #%d (order %v)", key, id, last[key], arrived)
		last[key] = n
	}
	require.Len(t, seen, keys*perKey+unkeyed, "every message arrived at least once")
	var retried int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE attempts > 1`).Scan(&retried))
	require.Positive(t, retried, "the failures really happened")
}

func TestCloseDuringAPassLeavesNoRowInFlight(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2", "m3", "m4", "m5")
	h := newHanger(t)
	var mu sync.Mutex
	var reports []forwarder.Report
	f := newForwarder(t, s.DB, h, forwarder.Config{
		Owner: "closing", Concurrency: 1, PublishTimeout: 5 * time.Second, DrainTimeout: 100 * time.Millisecond,
		OnReport: func(r forwarder.Report) { mu.Lock(); reports = append(reports, r); mu.Unlock() },
	})
	runErr := make(chan error, 1)
	go func() { runErr <- f.Run(context.Background()) }()
	<-f.Running()
	require.Equal(t, "m1", <-h.entered)
	require.NoError(t, f.Close())
	require.NoError(t, <-runErr)
	require.NoError(t, f.Close(), "twice is fine")
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT' AND lease_owner = 'closing'"))
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "m1").Status, "the publish in progress is unknown")
	require.Equal(t, 4, s.Count(t, "status = 'PENDING' AND attempts = 0"), "the rest were released, no attempt spent")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, reports, 1)
	require.Equal(t, 1, reports[0].Ambiguous)
	require.Equal(t, 4, reports[0].Released)
	var beats int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = 'closing'`).Scan(&beats))
	require.Zero(t, beats, "Close removes the relay's heartbeat")
}

func TestRunLifecycleRefusals(t *testing.T) {
	s := newDB(t)
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{})
	require.NoError(t, f.Close())
	require.NoError(t, f.Close())
	require.ErrorIs(t, f.Run(context.Background()), forwarder.ErrClosed)

	g := newForwarder(t, s.DB, &recorder{}, forwarder.Config{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	<-g.Running()
	require.ErrorIs(t, g.Run(ctx), forwarder.ErrAlreadyRunning)
	var beats int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = $1`, g.Owner()).Scan(&beats))
	require.Equal(t, 1, beats, "a running relay announces itself")
	cancel()
	require.NoError(t, <-done)
}

func TestRunRefusesACDCDatabase(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`UPDATE messaging_relay_mode SET mode = 'CDC'`)
	require.NoError(t, err)
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{})
	err = f.Run(context.Background())
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)

	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddPlugin(f.RouterPlugin())
	err = r.Run(context.Background())
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
	require.NoError(t, r.Close())
}

func TestEndToEndThroughGoChannel(t *testing.T) {
	s := newDB(t)
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 100}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	sub, err := ps.Subscribe(context.Background(), "orders")
	require.NoError(t, err)

	want := map[string]*message.Message{}
	ctx := context.Background()
	for i := range 3 {
		err := publisher.InTx(ctx, s.DB, publisher.Config{Notify: true}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			// The business change and its messages commit together.
			if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (id int PRIMARY KEY)`); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ($1)`, i); err != nil {
				return err
			}
			for j := range 2 {
				m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"n":%d}`, i*2+j)))
				m.Metadata.Set("app-header", "v\\")
				envelope.SetTenant(m, "acme")
				envelope.SetMessageType(m, "OrderPaid")
				envelope.SetAggregate(m, "order", fmt.Sprint(i), int64(j+1))
				envelope.SetCorrelationID(m, "corr-1")
				envelope.SetOccurredAt(m, t0)
				if err := pub.Publish("orders", m); err != nil {
					return err
				}
				want[m.UUID] = m
			}
			return nil
		})
		require.NoError(t, err)
	}
	rolledBack := watermill.NewUUID()
	errAbort := errors.New("business rule failed")
	err = publisher.InTx(ctx, s.DB, publisher.Config{Notify: true}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
		if err := pub.Publish("orders", message.NewMessage(rolledBack, []byte("never"))); err != nil {
			return err
		}
		return errAbort
	})
	require.ErrorIs(t, err, errAbort)

	f := newForwarder(t, s.DB, ps, forwarder.Config{Producer: "relay-svc"})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	got := map[string]*message.Message{}
	for len(got) < len(want) {
		m := <-sub
		m.Ack()
		got[m.UUID] = m
	}
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	require.NotContains(t, got, rolledBack)
	require.Equal(t, len(want), s.Count(t, "status = 'PUBLISHED'"))
	require.Zero(t, s.Count(t, "message_id = $1", rolledBack), "a rolled-back message never existed for the relay")
	for id, w := range want {
		g := got[id]
		require.NotNil(t, g, id)
		require.Equal(t, string(w.Payload), string(g.Payload))
		require.Equal(t, "v\\", g.Metadata.Get("app-header"))
		require.Equal(t, "acme", g.Metadata.Get(envelope.KeyTenant))
		require.Equal(t, "OrderPaid", g.Metadata.Get(envelope.KeyMessageType))
		require.Equal(t, w.Metadata.Get(envelope.KeyAggregateVersion), g.Metadata.Get(envelope.KeyAggregateVersion))
		require.Equal(t, "corr-1", g.Metadata.Get(envelope.WatermillCorrelationKey))
		require.Equal(t, t0.Format(time.RFC3339Nano), g.Metadata.Get(envelope.KeyOccurredAt))
		require.Equal(t, "relay-svc", g.Metadata.Get(envelope.KeyProducer))
	}
}

func TestListenNotifyWakesAnIdleRelay(t *testing.T) {
	s := newDB(t)
	rec := &recorder{}
	passes := make(chan struct{}, 100)
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		ListenURL: s.URL, PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(forwarder.Report) {
			select {
			case passes <- struct{}{}:
			default:
			}
		},
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	<-passes // the first pass found nothing; the next poll is an hour away
	insertN(t, s.DB, "orders", "m1")
	await.Until(t, func() bool {
		// NOTIFY again on every check: the listener may still be connecting.
		_, err := s.DB.Exec(`SELECT pg_notify($1, '')`, publisher.DefaultNotifyChannel)
		require.NoError(t, err)
		return len(rec.ids()) == 1
	}, "a NOTIFY wakes the relay, which delivers m1")
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
}

func TestRouterPluginStartsAndDrainsWithTheRouter(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "router-relay"})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddPlugin(f.RouterPlugin())
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-f.Running()
	await.Until(t, func() bool { return len(rec.ids()) == 1 }, "m1 is delivered")
	require.NoError(t, r.Close())
	require.NoError(t, <-done)
	<-f.Running()
	var beats int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = 'router-relay'`).Scan(&beats))
	require.Zero(t, beats, "closing the router stopped the relay cleanly")
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m1").Status)
}

func TestClassifierAndOutcomeNames(t *testing.T) {
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Confirmed}, forwarder.DefaultClassifier(nil))
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: forwarder.FailurePublishError}, forwarder.DefaultClassifier(errBroker))
	wrapped := fmt.Errorf("decorator: %w", forwarder.Reject(errBroker, ""))
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: forwarder.FailurePublishRejected}, forwarder.DefaultClassifier(wrapped))
	require.ErrorIs(t, wrapped, errBroker, "Reject keeps the cause")
	code, ok := forwarder.RejectionCode(forwarder.Reject(nil, "TOO_BIG"))
	require.True(t, ok)
	require.Equal(t, "TOO_BIG", code)
	require.Equal(t, "rejected: TOO_BIG", forwarder.Reject(nil, "TOO_BIG").Error())
	_, ok = forwarder.RejectionCode(errBroker)
	require.False(t, ok)
	require.Equal(t, "confirmed", forwarder.Confirmed.String())
	require.Equal(t, "rejected", forwarder.Rejected.String())
	require.Equal(t, "ambiguous", forwarder.Ambiguous.String())
	require.Equal(t, "Outcome(0)", forwarder.Outcome(0).String())
}
