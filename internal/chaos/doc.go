// Package chaos holds the chaos soak (TestChaosSoak): producers commit and
// roll back business rows with outbox messages while several relays run as
// separate OS processes (relayproc) and faults are injected at random, from
// a printed seed: SIGKILL and restart, SIGSTOP past the lease and SIGCONT,
// database connections cut and delayed by an in-process toxiproxy, backends
// terminated with pg_terminate_backend, and a downstream that errors, times
// out after accepting, rejects for good, or hangs. At the end the database
// and the delivery log are checked against the product's promises; see
// docs/SOAK.md for the checks and the latest long run.
//
// Short form (make test): a few hundred messages, about 30 seconds.
// Long form (make soak): OUTBOX_SOAK=long. OUTBOX_SOAK_SEED replays a seed.
package chaos
