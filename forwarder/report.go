// What a pass reports (summed by Run into metrics and logs).

package forwarder

import "time"

// Report counts what one pass did. Stale rows are possible duplicate
// publications: this relay's lease was gone when it wrote the outcome.
type Report struct {
	Claimed   int // rows the claim returned (including rows it parked)
	Published int
	Ambiguous int
	Failed    int
	Exhausted int // parked by this pass, or by the claim (expired lease, budget spent)
	Stale     int
	Released  int // claimed but not attempted (stopping, lease too short to start, the rest of a cut chain)
	// Chains is how many ordering keys the pass published a run of rows
	// for (each in seq order, one publish at a time); unkeyed rows are not
	// counted.
	Chains int
	// Unavailable counts rows put back without an attempt because their
	// downstream was unavailable as a whole (an unavailable verdict, the
	// evidence of a pass, or an open breaker); they are not in Released.
	Unavailable int
	// PossibleDuplicates counts rows confirmed now after an earlier attempt
	// whose outcome nobody knew (ambiguous, timed out, an expired lease):
	// the broker may have had them already.
	PossibleDuplicates int
	// ClaimFailures counts claim statements of the pass that failed (a row
	// that could not be read, a timeout, a cancelled context, a connection
	// lost while reading, or one that never reached the server: the client
	// cannot tell them apart, and such a claim may have committed).
	// ClaimReleased counts the rows then put back at once, without an
	// attempt, instead of waiting for their leases to expire (each expiry
	// spends one).
	ClaimFailures int
	ClaimReleased int
	// UnrecordedPublishes counts rows the downstream confirmed in this pass
	// whose outcome write then failed: they stay IN_FLIGHT until their
	// leases expire and are published again, so each is a possible
	// duplicate. They are not in Published or PossibleDuplicates.
	UnrecordedPublishes int
	// AbandonedPublishes is how many publishes left behind by their timeout
	// (a downstream that ignores its context) were still running when the
	// pass started. ClaimPaused: the pass claimed nothing because they were
	// more than Config.MaxAbandoned.
	AbandonedPublishes int
	ClaimPaused        bool
	// OpenBreakers are the destinations whose breaker is open after the
	// pass.
	OpenBreakers []BreakerState
	Duration     time.Duration
}
