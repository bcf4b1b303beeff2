package fencing

// The claim and outcome statements, for the tests that run them directly
// (generic plans, the all-PUBLISHED form against the general one, the claim
// under each policy). They are not part of the API: Claim and Apply pick
// between them, and ClaimStatement shows a caller (the benchmark) the claim
// it would run.
const (
	ApplySQL          = applySQL
	ApplyPublishedSQL = applyPublishedSQL
)

var (
	// ApplyStatement returns the general statement (general) or the
	// all-PUBLISHED one for outcomes, with its arguments.
	ApplyStatement = applyStatement
	// LaneApplyStatement is ApplyStatement for lane leases.
	LaneApplyStatement = laneApplyStatement
	ClaimBlockKeySQL   = claimBlockKeySQL
	ClaimSkipParkedSQL = claimSkipParkedSQL
)

// TakeLanesSQL is TakeLanes' statement (its charge of what a lapsed owner
// held finds the rows by seq).
var TakeLanesSQL = takeLanesSQL
