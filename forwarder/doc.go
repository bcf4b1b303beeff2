// Package forwarder is the relay of the fenced outbox: it publishes rows that
// business transactions committed to messaging_outbox to any watermill
// message.Publisher (Pub/Sub, Kafka, AMQP, NATS, GoChannel), at least once,
// under the row's message id. It replaces watermill's components/forwarder,
// which forwards one message at a time, lets one poison message block its
// topic, has no attempt budget, and gains no throughput from more instances.
//
// # The fence scheme
//
// Config.Fence chooses how the relay's outcomes are fenced: FenceRows (the
// default) leases each claimed row; FenceLanes has the relay own a fair
// share of the table's lanes and write each row once, its outcome
// (docs/FENCE.md; `outboxctl lanes set 32` builds the lanes' index first).
// Run refuses with FENCE_SCHEME_CONFLICT while a live relay of the other
// scheme runs. The rest of this page describes per-row leases; on lanes
// nothing of a claim is written (a row "IN_FLIGHT" is held in the relay's
// memory and recorded on its lane), and docs/FENCE.md says what differs and
// what is not shown on lanes yet.
//
// # A pass
//
// One pass claims up to BatchSize rows, or more while the relay is behind
// (below), (package fencing: one statement,
// FOR UPDATE SKIP LOCKED, a lease with an owner and a token), rebuilds each
// message with package envelope, publishes up to Concurrency of them at once,
// and writes every outcome in one fenced statement:
//
//   - Confirmed (Publish returned nil)        -> PUBLISHED
//   - Rejected (the Classifier says the broker will never take it; see
//     Reject)                                  -> FAILED, parked
//   - Ambiguous (any other error, a publish that ran past PublishTimeout even
//     if the publisher ignores its context, a panicking publisher)
//     -> AMBIGUOUS, retried after an exponential backoff, under the same id;
//     or EXHAUSTED (parked) when that was the last attempt of MaxAttempts.
//   - A row that cannot become a message (corrupt headers, a reserved header
//     name) -> FAILED with the envelope's error code; it is never retried.
//
// A write whose lease is gone (the relay stalled past LeaseDuration and
// another relay took the row) changes nothing and is counted as Stale in the
// Report and logged with message id, owner and token: the message may have
// been published twice. Every outcome is written or the pass fails loudly; a
// Classifier returning an outcome the forwarder does not know is recorded as
// AMBIGUOUS and the pass returns FORWARDER_UNKNOWN_OUTCOME. No row is left
// IN_FLIGHT by a pass that completes.
//
// # Claim size
//
// A relay that keeps up claims BatchSize rows per pass. When a claim comes
// back full, the next one takes twice as many, up to MaxBatchSize (1000 at
// the defaults), as long as the larger batch would be published within a
// quarter of its lease (its rows Concurrency at a time, a key's chain one
// at a time) at the mean time a publish took lately, and twice it (a batch
// claimed ahead waits for the one before it) before the start-by deadline
// (LeaseDuration - 1.5 x PublishTimeout); before any publish was timed a
// claim grows once, from BatchSize. A claim less
// than half full, or a pace that no longer fits (a slow downstream), halves
// it again, down to BatchSize. A larger claim costs less per row on both
// sides (one statement, one commit and one walk of the keys for many rows),
// so a relay behind a burst catches up instead of trailing it; the lease,
// the fence and the order per key are the same at any size. One key's
// chain is published one message at a time, so a claim takes at most as
// many rows of a key as the slowest destination lately (its mean publish
// time) publishes one by one within that quarter of the lease: at least
// BatchSize, at most MaxBatchSize, and BatchSize before any publish was
// timed. A hot key on a fast downstream then drains up to MaxBatchSize
// rows a pass, and one on a slow downstream in chains its pace can publish. A
// destination the relay has not published to lately is sized at the pace
// of the others until its first publishes, so its first batch or chain
// may be too long for the start-by deadline; the rows not started by then
// go back without an attempt. A BatchSize set without MaxBatchSize stays
// fixed.
//
// # Ordering
//
// Rows sharing an ordering key reach the publisher in seq order across any
// number of relays and retries. A claim returns, per key, a chain: the key's
// head (its earliest unpublished row) and the claimable rows right behind it:
// where the claim finds the key by walking the keys, at most
// ceil(claim size / Concurrency) of them, so that a batch spreads over
// several keys when several have work, then extended to fill the batch when
// few do; a chain this relay continues or resumes is not cut that way. Either
// way a claim takes at most as many rows of one key as the slowest
// destination lately publishes one by one within the window that sizes
// claims (see Claim size), between BatchSize and MaxBatchSize. A chain is
// published in seq order, one publish at
// a time, each waiting for the previous one's outcome; the first row that is
// not confirmed cuts it and the rows behind it are released without an
// attempt, in the same outcome statement. While a chain is in flight no other
// relay can claim any row of its key (the head is IN_FLIGHT); the claim made
// ahead may continue this relay's own chain (fencing.Continuation), and that
// continuation goes out only if the chain before it was confirmed to its end.
// Chains of different keys and unkeyed rows are published concurrently, up
// to Concurrency. A parked head blocks its key (fencing.BlockKey, the
// default) or is skipped (fencing.SkipParked). A pass that published rows
// of chains re-polls at once: the keys may have more behind them (a pass
// whose chains were all cut at their first row waits PollInterval, as an
// idle one does, so an unavailable key does not spin the relay).
//
// # Outages
//
// A publish the classifier calls Unavailable (the downstream as a whole did
// not take it) puts the row back without an attempt. Under DefaultClassifier
// a pass in which every publish to a destination failed with the same error,
// on two messages or more, counts as Unavailable too. Unanswered
// publishes of BreakerThreshold different messages to a destination, with
// no confirmed publish in between, open its breaker: its rows are no
// longer claimed, those held are given back without attempts, and one row
// is claimed as a probe every BreakerProbeBase, doubling to
// BreakerProbeMax, jittered per owner; the first confirmed publish closes
// it. Report.OpenBreakers, the
// outbox_forwarder_breaker_open gauge, one log line per change and Ready()
// show it.
//
// Duplicates are possible (at least once), and a duplicate can arrive late.
// A publish that runs past PublishTimeout (or the drain deadline) is recorded
// AMBIGUOUS, but it cannot be called back: a publisher that ignores its
// context keeps sending. If that abandoned send lands after all, its copy can
// reach the broker after the row's retry and after later rows of the same
// key. What holds (under fencing.BlockKey) is the order of first copies: a key's
// next row is claimed only once a publish of this row was confirmed, so each row's first
// confirmed copy precedes the next row's. Consumers that drop duplicates by
// message id (package inbox) see a key in seq order; others can see an old
// message again after newer ones.
//
// # Time and leases
//
// LeaseDuration must be at least twice PublishTimeout (refused otherwise with
// OUTBOX_LEASE_TOO_SHORT), and a publish is only started while it can finish
// and its outcome be written before the lease runs out; rows that cannot are
// released without spending an attempt. A retry delay is written as a delay
// and added to the database's clock (or Config.Now) by the outcome
// statement, the clock the claim compares with, so host clock skew neither
// removes nor stretches it. Retry delays and loop backoff carry
// jitter derived from the owner id: replicas spread differently, a given
// owner is deterministic. Config.Now injects the clock.
//
// # Running
//
// Run checks the relay mode (a database switched to CDC refuses with
// RELAY_MODE_CONFLICT), keeps a heartbeat (while heartbeats have failed for
// longer than their lifetime, 3 x HeartbeatInterval, a CDC switch could go
// through, so passes claim nothing and fail with FORWARDER_HEARTBEAT_LAPSED
// until one succeeds again), wakes on LISTEN/NOTIFY when
// ListenURL is set (never during a failure backoff, and after two woken
// passes in a row that found nothing not before PollInterval/10, 50 ms at
// most: any login can NOTIFY), polls otherwise (at once again while batches come back
// full, backing off with jitter while they come back empty), and keeps going
// after a failing pass (logged, counted, backed off). While a full batch is
// being published, Run already claims the next one on a second connection
// (prefetch; Config.DisablePrefetch turns it off), so the database works on
// that claim while the relay publishes; and it publishes that batch while the
// previous batch's outcome statement runs (pipelining, on by the same
// switch). Outcome statements still run one at a time, in pass order, each
// started as soon as its batch's publishes end, as without pipelining: what
// a crash leaves behind is the same. A relay then holds up to 3 x MaxBatchSize
// rows (the batch being published, the one claimed ahead, and the one before
// until its outcomes are written), and the claim ahead and the outcome statement each hold a
// connection of the pool while they run: the claims keep to one connection
// and the outcome statements to another (pinned) when the pool allows at
// least three (MaxOpenConns 0 or 3 and more), so that two PostgreSQL
// backends, not every one of the pool, map the outbox's pages and plan the
// relay's statements; with Config.ShareConnection both keep to one,
// taking turns, which costs the database less CPU and one relay some of
// its drain rate (docs/CONFIGURATION.md, "The relay's connections").
// Order
// per key is unaffected (rows stay IN_FLIGHT, blocking their keys for every
// claim, until their outcome commits), a prefetched batch's start-by deadline
// counts from its own claim, and it is reported as its own pass, once its
// outcomes are written (OnReport calls come in pass order, never two at
// once). A failing outcome statement is logged and backed off like a failing
// pass, when the next pass has finished publishing. Close, or
// cancelling Run's context, drains the pass in progress: publishes already
// started get DrainTimeout to finish, rows not yet started are released (a
// prefetched batch is released whole), every outcome statement still running
// finishes, and the heartbeat is removed; if the drain cannot write its
// outcomes (database gone), Run and Close return FORWARDER_OUTCOMES_NOT_WRITTEN. RouterPlugin ties all of this to a
// watermill Router; a Run that stops with an error there (RELAY_MODE_CONFLICT)
// closes the router, and Forwarder.RouterErr says why.
//
// # Containment
//
// What one row, one claim or one downstream does wrong stays with it:
//
//   - A claim that fails on this side after it was sent (a row that cannot
//     be read, Config.DBTimeout, a lost connection) may have committed on
//     the server. The relay then releases, by owner, every IN_FLIGHT row it
//     does not know it holds (claims run one at a time, so those are that
//     claim's rows): back to PENDING or AMBIGUOUS at once, no attempt spent,
//     instead of waiting for their leases to expire (each expiry spends
//     one). Report.ClaimFailures and Report.ClaimReleased count it,
//     outbox_forwarder_failed_claims_total and
//     outbox_forwarder_failed_claim_released_total follow. A row that can be
//     read but not rebuilt is parked FAILED on its own (OUTBOX_CORRUPT_ROW).
//   - A claim takes at most Config.MaxBatchBytes (default 8 MiB) of payload
//     and headers, cut in seq order by each of its statements, the later
//     ones within what the earlier left (a breaker probe's one row is
//     taken whatever its size); a single larger row goes out alone. With prefetch a relay holds up to three such batches.
//     Each failed claim halves the next claim's budget (down to one row) and
//     each successful one doubles it back, so a link too slow to read a full
//     batch within DBTimeout still delivers, a few rows at a time.
//   - A publish that overruns PublishTimeout is left behind (AMBIGUOUS). A
//     downstream that ignores its context keeps such publishes running:
//     while more than Config.MaxAbandoned (default 2 x Concurrency) still
//     run, the relay claims nothing and starts no further publish of the
//     batch in hand (its rows go back without an attempt; Report.ClaimPaused,
//     Report.AbandonedPublishes, outbox_forwarder_claims_paused_total, the
//     outbox_forwarder_abandoned_publishes gauge), so goroutines stay bounded
//     (TestOnePassLeavesAtMostMaxAbandonedBehind). A publish left behind has
//     its context cancelled, so a publisher that honours it stops sending;
//     none starts after the drain deadline.
//   - Rows the downstream confirmed whose outcome write failed stay IN_FLIGHT
//     until their leases expire and are published again: they are counted
//     as possible duplicates in Report.UnrecordedPublishes and
//     outbox_forwarder_unrecorded_publishes_total.
//
// # Where a claim starts
//
// A drain leaves index entries at the head of the claimable index that no
// claim can take: those of the rows it published, until VACUUM removes
// them, and those of the rows in flight (this relay's and other relays'
// batches). A claim that starts at the first entry visits them all: the
// longer the drain and the more relays, the slower each claim. So while a
// relay gets full batches, its claims of unkeyed rows start right after the
// last unkeyed row of its latest batch (fencing.ClaimParams.FromSeq). A
// claim that comes back short from there claims the rest from the first
// entry in the same pass, so a short batch still means nothing more was
// claimable; after it, after a failed claim, after a pass that gave rows
// back (released, or unavailable), and on every 16th claim, claims start at
// the first entry again. While batches come back full, a claimable row
// below the start waits, for 16 claims at most: a row whose transaction
// committed after later rows were drained, an AMBIGUOUS row whose retry came
// due, a row whose lease expired, a redriven row. Keyed rows are not bound
// by the start: keys are walked from their heads.
//
// # Observability
//
// With Config.Metrics set: outbox_forwarder_messages_total{outcome,destination},
// outbox_forwarder_passes_total, outbox_forwarder_pass_failures_total,
// outbox_forwarder_publish_duration_seconds{destination},
// outbox_forwarder_claim_batch_size, outbox_forwarder_breaker_open{destination},
// outbox_forwarder_failed_claims_total, outbox_forwarder_failed_claim_released_total,
// outbox_forwarder_unrecorded_publishes_total, outbox_forwarder_abandoned_publishes,
// outbox_forwarder_claims_paused_total (see Containment).
// Each publish runs in a span
// "outbox.publish <destination>" that continues the trace stored in the row;
// the message handed to the publisher carries that span in its context.
//
// # Inside
//
// A Forwarder composes three stages, each an unexported type owning its
// state behind its own locks, that hand each batch one way:
//
//   - the claimer (claimer.go) takes a batch: the lanes or the per-row
//     claims, the claim's size and byte budget, where it starts, the chains
//     it continues or resumes, the claim made ahead, the rows the relay
//     holds and the release after a failed claim, the batches' memory;
//   - the executor (executor.go) publishes it: the workers, PublishTimeout
//     and the drain deadline, publishes left running, the classification
//     of each publish, the breakers and their probes;
//   - the completer (complete.go) writes its outcomes (retried), reports
//     and logs each row, ends the pass, and hands back to the claimer what
//     the batch held (rows, chains, memory).
//
// A pass (pass.go) runs the three in turn; Run (forwarder.go) loops over
// passes, with the heartbeat, the wake-ups and the drain on the way out, its
// start and stop being internal/startstop's. The forwarder writes
// messaging_outbox only through package fencing.
package forwarder
