// Package status answers operators' questions about an outbox from the
// database alone: what is waiting, for how long, what is parked and why,
// which business flows are stuck, which relays are alive (polling relays and
// CDC consumers), which relay mode is active, and, per logical replication
// slot, how much WAL it retains, how far its consumer's confirmed position
// lags, its wal_status and safe_wal_size, and how many undelivered rows are
// older than it ([Slot], [ReadSlots]). [CheckOneCDCConsumer] is a readiness
// check that reports CDC consumers on more than one slot. `outboxctl status` and `outboxctl inspect` print what this
// package reads; [NewCollector] exposes the same backlog as Prometheus gauges.
//
// # Guarantees
//
//   - One place: every query `outboxctl status` runs on messaging_outbox is
//     a named constant in queries.go, and [Collect] is the only code that
//     runs them; the relay mode, the live relays and the live CDC consumers
//     are read with the relaymode package's own functions (ReadMode,
//     LiveRelays, LiveCDCConsumers), inside the same transaction.
//   - Consistent: [Collect] reads everything in one read-only REPEATABLE
//     READ transaction with one pinned clock, so the totals, the failure
//     codes and the stuck correlations describe the same instant.
//   - Cheap: every query against messaging_outbox is bounded (a LIMIT on the
//     rows it returns) and served by indexes: the unpublished rows are read
//     through the partial claimable and parked indexes (a BitmapOr, then
//     each backlog page once), so the cost follows the backlog, not the
//     published history. No index carries status (it would keep the claim
//     from being a HOT update), so a large backlog costs a read of its
//     pages per sample: with millions of waiting rows, raise
//     CollectorOptions.Interval. TestQueriesUseIndexes asserts it against 20,000
//     published rows on every run; EXPLAIN.md shows the plans.
//   - Read-only: nothing here writes.
//
// # Metrics
//
// [Collector] samples the backlog at most once per CollectorOptions.Interval
// after a successful sample, whatever the scrape rate (scrapes inside the
// interval read the cached sample; concurrent scrapes wait for one query). A
// failed sample is retried on the next scrape. Labels are bounded: the
// destination label is capped at CollectorOptions.MaxDestinations (the rest
// summed under "_other"), tenants and message ids never become labels. A
// failed sample does not fail the scrape: the previous sample is served and
// outbox_backlog_sample_errors_total grows. The forwarder's own counters,
// latency histograms and spans live in the forwarder package.
//
// # Errors
//
// [Message] returns STATUS_MESSAGE_NOT_FOUND ([ErrMessageNotFound]) for an
// unknown id, including one no row can have (a NUL byte or invalid UTF-8,
// refused before any query), and OUTBOX_MESSAGE_ID_REQUIRED for an empty one. Negative
// options are refused with OUTBOX_INVALID_CONFIG.
package status
