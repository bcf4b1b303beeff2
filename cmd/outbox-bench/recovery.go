package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Recovery after a downstream outage (issue 19): a backlog, the downstream
// unavailable for cfg.Outage (every Publish fails as a broker that is down
// fails), then up; measured is the time from the moment it is up again to
// the moment every message of the backlog has arrived. Beside it, in the
// same repetition: watermill's tuned forwarder through the same outage, and
// an undisturbed drain of the same backlog by each.

// unavailable marks a publish error as "the downstream as a whole is
// unavailable" (issue 19): the default classifier puts the row back without
// an attempt and counts the failure towards the destination's breaker.
var unavailable = forwarder.MarkUnavailable

// breakerProbeInterval is the slack the recovery target allows beyond an
// undisturbed drain: one breaker probe interval at the forwarder's defaults.
// The interval starts at BreakerProbeBase and doubles up to BreakerProbeMax
// (1 s to 30 s: after the default 60 s outage it has reached the maximum),
// so the maximum is the interval in effect when the downstream comes back.
const breakerProbeInterval = forwarder.DefaultBreakerProbeMax

// recoveryKinds are the relays taken through the outage.
var recoveryKinds = []string{relayOurs, relayWMTuned}

func recoveryName(kind, what string) string { return fmt.Sprintf("recovery/%s/%s", kind, what) }

// downstream is the sink's publisher with an off switch: while down, every
// Publish fails with unavailable("broker unavailable") and forwards nothing.
type downstream struct {
	next    message.Publisher
	down    atomic.Bool
	refused atomic.Int64
}

func (d *downstream) Publish(topic string, msgs ...*message.Message) error {
	if d.down.Load() {
		d.refused.Add(1)
		return unavailable(errors.New("broker unavailable"))
	}
	return d.next.Publish(topic, msgs...)
}

func (d *downstream) Close() error { return nil }

// recoveryResult is one relay's recovery.
type recoveryResult struct {
	seconds     float64 // from the downstream's recovery to the last message arriving
	undelivered int     // messages still missing when the wait gave up (0: all arrived)
	refused     int64   // Publish calls refused during the outage
	exhausted   int     // rows left EXHAUSTED (ours)
	maxAttempts int     // the highest attempts count of a row afterwards (ours)
}

// recoveryCell fills n rows for kind, runs one relay of kind against a
// downstream that is down for outage, then up, and waits up to timeout for
// the backlog to arrive. A backlog that does not arrive in time is not an
// error: the result says how many messages are missing.
func recoveryCell(ctx context.Context, e *env, kind string, n int, outage time.Duration, payload []byte, timeout time.Duration) (recoveryResult, error) {
	var res recoveryResult
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return res, err
	}
	defer s.drop()
	if err := fillFor(ctx, s, kind, n, payload); err != nil {
		return res, err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	snk, err := newSink(sctx, n)
	if err != nil {
		return res, err
	}
	defer snk.close()
	// Distinct arrivals: a message sent again after an ambiguous outcome
	// counts once.
	var mu sync.Mutex
	arrived := make(map[string]struct{}, n)
	all := make(chan struct{})
	snk.onMessage = func(m *message.Message, _ time.Time) {
		mu.Lock()
		defer mu.Unlock()
		if _, ok := arrived[m.UUID]; ok {
			return
		}
		arrived[m.UUID] = struct{}{}
		if len(arrived) == n {
			close(all)
		}
	}
	ds := &downstream{next: snk.ch}
	ds.down.Store(true)
	r, err := startRelay(sctx, s, kind, 1, ds, false)
	if err != nil {
		return res, err
	}
	defer r.stop()
	select {
	case <-time.After(outage):
	case <-ctx.Done():
		return res, ctx.Err()
	}
	ds.down.Store(false)
	up := time.Now()
	res.refused = ds.refused.Load()
	select {
	case <-all:
	case <-time.After(timeout):
	case <-ctx.Done():
		return res, ctx.Err()
	}
	res.seconds = time.Since(up).Seconds()
	mu.Lock()
	res.undelivered = n - len(arrived)
	mu.Unlock()
	r.stop()
	if kind != relayWMDefault && kind != relayWMTuned {
		if err := s.db.QueryRowContext(ctx, `SELECT count(*) FILTER (WHERE status = 'EXHAUSTED'), coalesce(max(attempts), 0)
  FROM messaging_outbox`).Scan(&res.exhausted, &res.maxAttempts); err != nil {
			return res, err
		}
	}
	return res, nil
}

// runRecovery runs, per relay kind, the backlog through the outage, beside
// an undisturbed drain of the same backlog by the same relay: the drain
// cell of this repetition (rep) when it drained the same backlog, else one
// run right before.
func runRecovery(ctx context.Context, e *env, cfg Config, c *collector, rep int, payload []byte, logf func(string, ...any)) error {
	n := cfg.RecoveryBacklog
	timeout := max(cfg.DrainTimeout, time.Duration(n/200)*time.Second)
	for _, kind := range recoveryKinds {
		var rate float64
		if r, ok := c.by[drainName(kind, 1)]; ok && len(r.Samples) == rep && n == cfg.Backlog {
			rate = r.Samples[rep-1]
		} else {
			st, err := drainCell(ctx, e, drainKind{kind, 1, 0}, n, payload, timeout)
			if err != nil {
				return fmt.Errorf("recovery %s, undisturbed: %w", kind, err)
			}
			rate = st.rate
		}
		undisturbed := float64(n) / rate
		res, err := recoveryCell(ctx, e, kind, n, cfg.Outage, payload, timeout)
		if err != nil {
			return fmt.Errorf("recovery %s: %w", kind, err)
		}
		c.add("recovery", recoveryName(kind, "undisturbed-drain"), "s", undisturbed)
		c.add("recovery", recoveryName(kind, "after-outage"), "s", res.seconds)
		c.add("recovery", recoveryName(kind, "undelivered"), "msgs", float64(res.undelivered))
		c.add("recovery", recoveryName(kind, "refused-publishes"), "calls", float64(res.refused))
		if kind == relayOurs {
			c.add("recovery", recoveryName(kind, "allowed"), "s", undisturbed+breakerProbeInterval.Seconds())
			c.add("recovery", recoveryName(kind, "exhausted"), "rows", float64(res.exhausted))
			c.add("recovery", recoveryName(kind, "max-attempts"), "attempts", float64(res.maxAttempts))
		}
		logf("  %-28s undisturbed %.2fs, after a %s outage %.2fs to empty (%d undelivered, %d publishes refused, %d EXHAUSTED, max attempts %d)",
			"recovery/"+kind, undisturbed, cfg.Outage, res.seconds, res.undelivered, res.refused, res.exhausted, res.maxAttempts)
	}
	return nil
}
