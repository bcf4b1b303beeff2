package cdcrelay

import "time"

// StopBound is the longest a stop may take with this configuration
// (defaults filled in): from Close, or the end of Run's context, to Run's
// return, with every step the stop waits for running into its own timeout.
// A supervisor that gives the relay less kills it before it has marked what
// it published (those messages are published again) or confirmed its last
// position (the last transactions are streamed again, the marked rows
// skipped), and before it has removed its heartbeat (`outboxctl debezium
// disable` then refuses until HeartbeatTTL has passed).
//
// It adds up the longest path through the stop:
//
//   - the step in progress: a publish gets DrainTimeout, then it is left
//     behind (its row is not marked, its transaction not confirmed); a
//     standby status update being written (pglogrepl takes no context; a
//     server that stopped reading blocks the write) ends within DBTimeout.
//     Whatever else may be in progress (a statement, a heartbeat renewal,
//     the wait for a replication message, the backoff after a refused
//     publish, the wait for a busy slot) runs under Run's context and ends
//     with it. No further message is published: max(DrainTimeout,
//     DBTimeout);
//   - marking the rows the downstream accepted PUBLISHED (both marking
//     statements and the wait for the streamed transaction between them
//     share it): DBTimeout. Either the mark of a transaction whose last
//     publish ended (not cut by the stop: the transaction is then
//     confirmed below), or, when the stop cut a transaction short, the
//     mark of what was published of it; a mark that failed during the
//     stop is not tried again;
//   - the last standby status update and CopyDone, one deadline on the
//     replication connection for both: DBTimeout;
//   - closing the replication connection: DBTimeout;
//   - removing the heartbeat: DBTimeout.
//
// So StopBound = max(DrainTimeout, DBTimeout) + 4 x DBTimeout. A stop while the slot is being
// created cleans it up instead of streaming (closing that connection,
// dropping the slot and its boundary row: one DBTimeout for all) and then
// removes the heartbeat: 2 x DBTimeout, within the bound. A stop that ends
// sooner is the rule (every term is a timeout); the bound is what a
// database answering at the edge of DBTimeout, and a downstream that does
// not answer, cost (TestCloseReturnsWithinStopBound).
//
// The bound counts what Run waits for, one timeout per step. Statements on
// Config.DB end at their context's end when the server answers the
// driver's cancel request (lib/pq waits for the cancelled statement); a
// connection that stops answering altogether is not bounded by it, so a
// supervisor that must end within the bound stops waiting for Run at
// StopBound. HandOverToPolling is not a stop: it ends when its context
// does.
func (c Config) StopBound() time.Duration {
	c = c.withDefaults()
	return max(c.DrainTimeout, c.DBTimeout) + 4*c.DBTimeout
}
