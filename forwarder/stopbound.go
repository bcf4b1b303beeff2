package forwarder

import "time"

// StopBound is the longest a stop may take with this configuration
// (defaults filled in): from Close, or the cancellation of Run's context, to
// Run's return, with every statement the stop waits for running into its own
// timeout. A supervisor that gives the relay less kills it with rows
// IN_FLIGHT, each of which then costs an attempt when its lease expires.
//
// It adds up the longest path through the stop:
//
//   - the pass in progress publishes for at most DrainTimeout; then it
//     writes the breaker changes its publishes caused (the breaker rows,
//     and on closing the rows held off during the outage), all of them,
//     however many destinations changed, under one deadline: 2 x DBTimeout
//     (TestCloseReturnsWithinStopBoundWhenManyBreakersChange);
//   - the outcome write of that pass, and the final one that releases the
//     batch claimed ahead (written after it, in pass order): 2 x DBTimeout.
//     The previous pass's outcome write and the claim ahead (a claim's
//     statements, and the breakers its probes closed, share one
//     DBTimeout, then the release of what a failed statement may hold: 2 x
//     DBTimeout) began before the stop and run
//     meanwhile: DBTimeout is at most half of LeaseDuration, and
//     DrainTimeout plus the writes above covers them;
//   - a heartbeat sent just before the stop may take its own timeout,
//     HeartbeatInterval, from before the stop (under FenceLanes, then the
//     renewal of the relay's lanes: DBTimeout more): the stop waits for it;
//   - giving back the lanes, removing the heartbeat and the breaker rows:
//     one DBTimeout for all.
//
// So StopBound = max(DrainTimeout + 4 x DBTimeout, HeartbeatInterval (+
// DBTimeout under FenceLanes)) + DBTimeout. A stop that ends sooner is the rule (every term is a timeout);
// the bound is what a database answering at the edge of DBTimeout costs.
//
// The bound counts what Run waits for as documented, one timeout per
// statement. It is not a bound on a lib/pq statement whose connection stops
// answering altogether (a cut network: the driver's cancel request waits for
// the same server); a supervisor that must end within the bound stops
// waiting for Run at StopBound (as `outboxctl relay` does). A claim whose
// statement failed runs none of its remaining statements, and a heartbeat
// is bounded by DBTimeout too (when shorter than HeartbeatInterval), so the
// terms above are upper bounds.
func (c Config) StopBound() time.Duration {
	c = c.withDefaults()
	db := c.DBTimeout
	beat := c.HeartbeatInterval
	if c.Fence == FenceLanes {
		beat += db
	}
	return max(c.DrainTimeout+4*db, beat) + db
}
