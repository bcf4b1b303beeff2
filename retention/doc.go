// Package retention keeps the outbox (and the inbox) from growing without
// bound, without stalling the relay or business writes.
//
// A [Cleaner] run removes rows past a horizon in bounded batches. Each batch
// is its own short transaction: a CTE picks at most BatchSize ids with
// FOR UPDATE SKIP LOCKED and deletes exactly those (or, with Archive, moves
// them into messaging_outbox_archive in the same statement), under a
// SET LOCAL statement_timeout. Rows a relay or a writer holds are skipped,
// never waited for, and a batch holds its row locks only until it commits,
// so concurrent claims and inserts wait at most one batch. A run stops when a
// batch comes back short (nothing more is old enough) or after MaxBatches
// batches (Result.More then says work remains).
//
// # Which rows go
//
// ByPublishedAt (the default) removes only PUBLISHED rows whose published_at
// is older than the horizon (72h by default). PENDING, IN_FLIGHT, AMBIGUOUS,
// FAILED and EXHAUSTED rows are never touched: they are either still to be
// delivered or parked for an operator.
//
// ByCreatedAt is for CDC relay mode ONLY. A CDC connector (Debezium) streams
// inserts from the WAL and never writes back, so in that mode no row is ever
// marked PUBLISHED and ByPublishedAt would delete nothing, forever. ByCreatedAt
// removes every row whose created_at is older than the horizon, whatever its
// status. There is no created_at index (it would cost every insert): rows
// never published nor parked (in CDC mode, all of them) are removed in
// insertion order up to the first one that is not old yet, so a row whose
// transaction started before the horizon but inserted after a younger row
// goes in a later run (late by at most that transaction's length, never
// early); parked rows go by created_at; PUBLISHED rows left from polling mode
// go once their published_at is past the horizon. Choose a horizon comfortably longer than the connector's worst lag:
// a row deleted before the connector read its insert from the WAL is still
// delivered (the WAL keeps the insert), but it is gone from the table for
// anyone who wants to inspect it. Never use ByCreatedAt with the polling
// forwarder: it would delete undelivered and parked rows. [Cleaner.Run]
// enforces this: with ByCreatedAt it reads the relay mode the database
// records (relaymode.CurrentMode) and, unless it is CDC, refuses with
// RELAY_MODE_CONFLICT before removing anything. The mode is read at the start
// of each run; switching back to polling (`outboxctl debezium disable`) while a
// ByCreatedAt run is in progress is not detected until the next run, so stop
// scheduled ByCreatedAt runs before switching.
//
// Inbox rows (messaging_inbox) are removed by processed_at when InboxHorizon
// is set, in the same bounded form; zero leaves the inbox alone.
//
// # Floors
//
// Horizon below DefaultHorizon (72h) and InboxHorizon below MinInboxHorizon
// (7 days, the default redelivery window of Pub/Sub and Kafka: an inbox id
// removed sooner lets a redelivered message repeat its effect) are refused
// with RETENTION_HORIZON_BELOW_FLOOR unless Config.AllowShortHorizons is
// set; New logs every Cleaner built with such an override.
//
// # One run at a time
//
// Run takes a session-level PostgreSQL advisory lock (pg_try_advisory_lock)
// on a dedicated connection for the whole run. The key is derived from the
// outbox table the connection resolves, so replicas of one deployment
// exclude each other and deployments in other schemas do not. When the lock
// is taken, Run returns at once with Result.Skipped = true and a nil error:
// an overlapping scheduled run is expected, not a failure; Result.HeldBy
// names the sessions holding the lock (a login that keeps it stops
// retention, and outboxctl cleanup exits 5 then). Scheduling is the
// application's choice: call Run from its own scheduler, use
// [Cleaner.Every], or run `outboxctl cleanup`.
//
// # Archive mode
//
// With Archive, each batch moves rows (every column, routing_key and seq as
// plain values, plus archived_at) into messaging_outbox_archive in one
// statement, so a row is always in exactly one of the two tables. The archive
// is keyed by message_id, and an id that is already there is settled per row,
// so the batch and the run go on: when the archive holds the same message
// (the columns the envelope carries; attempts, leases and timestamps aside)
// the outbox row is deleted as archived and the archive keeps its copy
// (Result.ArchiveDuplicates); when it holds a different one, the outbox row
// stays, its status unchanged, with last_failure_code
// RETENTION_ARCHIVE_CONFLICT and a detail naming the message id
// (Result.ArchiveConflicts), and later runs pass over it until an operator
// removes one of the two and clears the code. The row is not parked FAILED:
// that would put a delivered row back among the unpublished ones, where it
// would hold back its ordering key and a redrive would deliver it again.
// Pruning the archive is left to the team that needs it.
package retention
