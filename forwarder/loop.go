// The loop's stop discipline and clocks: stop and drain signals shared by
// Run and RunOnce, the wake-up listener's start, and the two clocks (the
// one passed to SQL, the local one for deadlines).

package forwarder

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// stopRequested reports whether ctx was cancelled or Close called. It reads
// them directly as well as stopping, which another goroutine closes a moment
// after them: a pass started in that moment would take the batch claimed
// ahead as an ordinary pass instead of the final one that releases it.
func (f *Forwarder) stopRequested(ctx context.Context, stopping <-chan struct{}) bool {
	select {
	case <-stopping:
	case <-ctx.Done():
	case <-f.life.Stopping():
	default:
		return false
	}
	return true
}

// stopSignals returns a channel closed when ctx is cancelled or Close is
// called, and one closed DrainTimeout after that.
func (f *Forwarder) stopSignals(ctx context.Context, exit <-chan struct{}) (stopping, drainExpired chan struct{}) {
	stopping, drainExpired = make(chan struct{}), make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-f.life.Stopping():
		case <-exit:
		}
		close(stopping)
		t := time.NewTimer(f.cfg.DrainTimeout)
		defer t.Stop()
		select {
		case <-t.C:
		case <-exit:
		}
		close(drainExpired)
	}()
	return stopping, drainExpired
}

// listen starts the configured Listener (listen.go) on Config.NotifyChannel
// and returns a channel that receives a value per wake-up (nil channel when
// none is configured). Nothing here blocks the caller; the listener runs in
// the background until stopping is closed. Polling carries the load meanwhile.
func (f *Forwarder) listen(stopping <-chan struct{}, bg *sync.WaitGroup) <-chan struct{} {
	return startListening(f.cfg, f.logger, stopping, bg)
}

// RunOnce runs one pass: claim a batch, publish it, write the outcomes. It
// does not check the relay mode or send heartbeats (Run does); tools and
// tests use it. Cancelling ctx drains the pass like Close does.
func (f *Forwarder) RunOnce(ctx context.Context) (Report, error) {
	stopping, drainExpired := make(chan struct{}), make(chan struct{})
	exit := make(chan struct{})
	defer close(exit)
	go func() {
		select {
		case <-ctx.Done():
		case <-exit:
			return
		}
		close(stopping)
		t := time.NewTimer(f.cfg.DrainTimeout)
		defer t.Stop()
		select {
		case <-t.C:
			close(drainExpired)
		case <-exit:
		}
	}()
	t, _ := f.pass(ctx, stopping, drainExpired, nil, false, nil)
	defer f.claimer.waitFloors()
	defer f.unpin() // a pass on its own leaves no connection pinned
	return t.wait()
}

// dbNow is the clock passed to SQL: zero (server time) unless injected.
func (e *env) dbNow() time.Time {
	if e.cfg.Now != nil {
		return e.cfg.Now()
	}
	return time.Time{}
}

func (e *env) localNow() time.Time {
	if e.cfg.Now != nil {
		return e.cfg.Now()
	}
	return time.Now()
}

// heartbeat renews the relay's heartbeat every HeartbeatInterval until
// stopping closes. A relay-mode conflict (a CDC switch made while this
// relay's heartbeat had lapsed) is sent on fatal and ends it; any other
// failure is logged, and claims stop once beats have failed for longer than
// their lifetime ttl (claimer.claim).
func (f *Forwarder) heartbeat(ctx context.Context, stopping <-chan struct{}, ttl time.Duration, fatal chan<- error) {
	t := time.NewTicker(f.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-stopping:
			return
		case <-t.C:
			// A beat that took longer than the period leaves a tick ready
			// beside stopping, and select picks among ready cases at random:
			// without this check a stop on a slow database waited for beat
			// after beat (seen: seven, 9 s, past outboxctl's stop bound).
			select {
			case <-stopping:
				return
			default:
			}
			// A beat is bounded like every statement of the relay (and by its
			// period, when shorter), so a stop never waits an hour-long
			// HeartbeatInterval for a beat stuck on a silent database.
			hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(f.cfg.HeartbeatInterval, f.dbTimeout))
			sent := f.beat.since()
			err := relaymode.BeatFence(hctx, f.db, f.cfg.Owner, ttl, f.cfg.MaxAttempts, f.beatFence())
			cancel()
			if err == nil {
				f.beat.sent(sent)
			}
			if f.cfg.Fence == FenceLanes {
				lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.dbTimeout)
				f.claimer.renewLanes(lctx)
				cancel()
			}
			if errors.Is(err, relaymode.ErrRelayModeConflict) {
				fatal <- err
				return
			}
			if err != nil {
				f.logger.Error("Relay heartbeat failed; claims stop once it has failed for longer than its lifetime", err, watermill.LogFields{"ttl": ttl})
			}
		}
	}
}

// sleep waits delay before the next pass. A notification on wake (nil: none
// may cut this wait) ends it early, but not before wakeGap has passed since
// idleAt (wakeLimit: the start of the last woken pass that found nothing,
// when two did in a row), so a NOTIFY flood cannot turn the relay into a
// busy loop. It reports whether a
// notification ended the wait, whether stopping closed, and a fatal error.
func (f *Forwarder) sleep(delay time.Duration, wake <-chan struct{}, stopping <-chan struct{}, fatal <-chan error, idleAt time.Time) (woken, stop bool, err error) {
	t := time.NewTimer(delay)
	defer t.Stop()
	deadline := time.Now().Add(delay)
	for {
		select {
		case <-stopping:
			return false, true, nil
		case err := <-fatal:
			return false, false, err
		case <-wake:
			wake, woken = nil, true
			if d := time.Until(idleAt.Add(wakeGap(f.cfg.PollInterval))); d > 0 {
				t.Reset(min(d, time.Until(deadline)))
				continue
			}
			return true, false, nil
		case <-t.C:
			return woken, false, nil
		}
	}
}

// wakeGap is how long after a pass that a notification started and that
// claimed nothing (the second such in a row, see wakeLimit) the next woken
// pass may begin: PollInterval/10 (50 ms by default), never more than
// 50 ms, so that a relay polling rarely (PollInterval of minutes, leaning on
// NOTIFY) still wakes at once for each of a few commits while a NOTIFY flood
// is held to 20 passes/s.
func wakeGap(poll time.Duration) time.Duration { return min(poll/10, 50*time.Millisecond) }

// wakeLimit holds woken passes back while notifications bring no rows. Any
// login may NOTIFY the channel, so a flood of notifications must not start a
// pass each. But a notification that brings no row is also ordinary: one
// that arrives while a pass runs, for a row that pass claims, starts a pass
// that finds nothing (notifications arriving meanwhile coalesce into one
// wake). Held back after such a pass, the next commit's row waited up to
// the whole gap (a p99 of 30-40 ms at 200 msg/s). So the gap applies from
// the second woken pass in a row that claimed nothing.
type wakeLimit struct {
	empty  int       // woken passes in a row that claimed nothing
	idleAt time.Time // when the last of them began, once two were in a row
}

// passed counts a woken pass, begun at wokenAt, that claimed claimed rows.
func (w *wakeLimit) passed(wokenAt time.Time, claimed int) {
	if claimed > 0 {
		w.empty = 0
		return
	}
	if w.empty++; w.empty >= 2 {
		w.idleAt = wokenAt
	}
}
