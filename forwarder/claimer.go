// The claimer: the first stage of a pass. It decides which rows a pass
// takes and takes them (claim.go), owns where claims start (claimstart.go),
// which chains it continues and resumes (chains.go), how large a claim is
// (its size, its byte budget, the publish pace it is sized by: pace.go),
// the rows the relay holds IN_FLIGHT and the release after a failed claim
// (contain.go), the lanes under FenceLanes (lanes.go) and the batches'
// memory (batchmem.go). It publishes nothing and writes no outcome.

package forwarder

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// claimer owns the claim's state; the executor reads its chain log and
// feeds its paces, the completer hands back what a batch no longer holds
// (returns).
type claimer struct {
	*env
	beat   *beatGate   // claims wait for a fresh heartbeat under Run
	probes probeSource // the executor's breakers

	start  claimStart // where each claim starts in the claimable index, and the key walk
	chains chainLog   // which of this relay's chains were confirmed to their end
	paces  paces      // every publish's time (the executor adds them), taken per claim

	// claimMu makes one claim (with the release after a failed one) run at
	// a time, and guards what follows up to budgetShift.
	claimMu sync.Mutex
	size    int // the next claim's size, BatchSize to MaxBatchSize
	// pace is the mean time a publish took between the last two claims,
	// and slowest the slowest destination's lately: paces accumulates every
	// publish (call.end), and each claim takes them (takePace) for nextSize
	// and chainMax.
	pace, slowest time.Duration
	// budgetShift halves the claims' byte budget once per failed claim and
	// doubles it back once per successful one: a link too slow to read
	// MaxBatchBytes within DBTimeout still makes progress, down to one row
	// per claim, instead of failing the same claim forever.
	budgetShift int

	mem chan *batchMem // finished batches' memory, for the next (keptBatches at most)
	// held are the rows this relay holds IN_FLIGHT (claimed, outcome not
	// yet written), by message id, with their seq and the local time of
	// their claim: a failed claim releases every other row of this owner,
	// and a lane claim skips them (by seq).
	heldMu sync.Mutex
	held   map[string]heldRow
	// claiming is the local time the lane claim in progress started (zero:
	// none; set by claimLanes once the claim's lanes are renewed), under
	// heldMu: its rows are held from then on, though recorded in held only
	// once its statements returned (heldSince).
	claiming time.Time
	// lanes are the lanes this relay owns (FenceLanes), under lanesMu.
	lanesMu sync.Mutex
	lanes   laneKeeper
	// floors is the advance of the lanes' floors in progress, beside the
	// claims (lanes.go): floorsBusy while one runs, floorsRun to wait for
	// it when the relay stops.
	floorsBusy atomic.Bool
	floorsRun  sync.WaitGroup
}

// probeSource is the breakers as a claim uses them: which destinations to
// leave out and which to probe, where a probe starts, and what it found.
type probeSource interface {
	forClaim() (exclude, probe []string)
	probeFrom(dest string) int64
	probed(dest string, seq int64)
	// probeNothing: the probe found no row of dest.
	probeNothing(dest string)
	// writeBreakers writes the breaker changes not written yet under ctx.
	writeBreakers(ctx context.Context)
}

func newClaimer(e *env, beat *beatGate) *claimer {
	return &claimer{env: e, beat: beat, size: e.cfg.BatchSize, mem: make(chan *batchMem, keptBatches)}
}
