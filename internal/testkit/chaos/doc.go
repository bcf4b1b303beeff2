// Package chaos holds the chaos soak (TestChaosSoak): producers commit and
// roll back business rows with outbox messages while several relays run as
// separate OS processes (relayproc) and faults are injected at random, from
// a printed seed: SIGKILL and restart, SIGSTOP past the lease and SIGCONT,
// database connections cut and delayed by an in-process toxiproxy, backends
// terminated with pg_terminate_backend, restarts of the outbox's PostgreSQL
// (a throwaway cluster the test starts), a downstream that errors, times
// out after accepting, rejects for good, hangs, or hangs forever over a
// window (relays sent SIGTERM meanwhile), poison rows written by SQL, and an
// operator running retention, redrives and purges beside the relays; a
// consumer handles every delivery through the inbox. At the end the
// databases, the delivery log and the relays' reports are checked against
// the product's promises; see docs/SOAK.md for the checks and the latest
// runs.
//
// Short form (make test): a few hundred messages, under a minute, one
// ordering policy (from the seed). Long form (make soak): OUTBOX_SOAK=long,
// both policies. OUTBOX_SOAK_SEED replays a seed; OUTBOX_SOAK_ORDERING=block
// or skip pins the policy.
package chaos
