// The executor: the stage of a pass between the claim and the outcome
// write. It publishes a pass's units (publish.go), classifies each publish
// into an outcome (classify.go), leaves publishes that overrun their timeout
// behind (abandoned), and keeps the per-destination breakers and their
// probes (breaker.go). It claims nothing and writes no outcome.

package forwarder

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// executor owns the downstream publisher, the breakers and the count of
// publishes left running. It reads the claimer's chain log (a continued
// chain goes out only behind one confirmed to its end; each unit records
// how far its chain got) and feeds the claimer's publish pace.
type executor struct {
	*env
	out      message.Publisher
	breakers breakers // per destination: is the downstream down as a whole
	// abandoned counts publishes left running after their timeout.
	abandoned atomic.Int64
	chains    *chainLog // the claimer's
	paces     *paces    // the claimer's pace feed: every publish's time
	beat      *beatGate // breakers are recorded for operators under Run only
	// changes are the breaker changes not written yet (writeBreakers).
	changes breakerChanges
	// spanNames maps a destination to its publish span's name, built once
	// per destination instead of once per message (for the first
	// maxSpanNames destinations; the others build theirs every time).
	spanNames  sync.Map // string -> string
	spanNamesN atomic.Int32
}

// maxSpanNames bounds executor.spanNames: a relay publishing to ever new
// destinations must not keep a name for each.
const maxSpanNames = 1024

func newExecutor(e *env, out message.Publisher, chains *chainLog, p *paces, beat *beatGate) *executor {
	x := &executor{env: e, out: out, chains: chains, paces: p, beat: beat}
	x.breakers = breakers{
		threshold: e.cfg.BreakerThreshold, base: e.cfg.BreakerProbeBase, max: e.cfg.BreakerProbeMax,
		jitter: func(base, ceiling time.Duration, n int) time.Duration { return e.jittered(base, ceiling, n, 2) },
		now:    e.localNow,
	}
	return x
}

// spanName is the name of the span of a publish to dest.
func (x *executor) spanName(dest string) string {
	if n, ok := x.spanNames.Load(dest); ok {
		return n.(string)
	}
	n := "outbox.publish " + dest
	if x.spanNamesN.Load() < maxSpanNames {
		if _, loaded := x.spanNames.LoadOrStore(dest, n); !loaded {
			x.spanNamesN.Add(1)
		}
	}
	return n
}

// leftRunning is how many publishes left behind by their timeout still run.
func (x *executor) leftRunning() int64 { return x.abandoned.Load() }

// overloaded reports whether more publishes than MaxAbandoned are left
// running: no claim is made, and no publish started, meanwhile.
func (x *executor) overloaded() bool { return x.abandoned.Load() > int64(x.cfg.MaxAbandoned) }

// claimPaused reports (and records in t) whether too many publishes left
// behind by their timeout still run for this pass to claim.
func (x *executor) claimPaused(t *tail) bool {
	n := x.abandoned.Load()
	t.rep.AbandonedPublishes = int(n)
	if n <= int64(x.cfg.MaxAbandoned) {
		return false
	}
	t.rep.ClaimPaused = true
	x.warn("Outbox relay claims nothing while too many publishes left behind by their timeout still run (the downstream ignores its context)", watermill.LogFields{
		"abandoned": n, "max_abandoned": x.cfg.MaxAbandoned,
	})
	return true
}

// probeNothing closes dest's breaker when a probe claim found no row of it
// (another relay delivered it, or it was parked): an open breaker has
// nothing left to protect; the next publish there tells again.
func (x *executor) probeNothing(dest string) {
	if x.breakers.success(dest) {
		x.breakerChanged(dest, false, "")
	}
}

// The breakers as the claimer sees them (probeSource).
func (x *executor) forClaim() (exclude, probe []string) { return x.breakers.forClaim() }
func (x *executor) probeFrom(dest string) int64         { return x.breakers.probeFrom(dest) }
func (x *executor) probed(dest string, seq int64)       { x.breakers.probed(dest, seq) }
