// Package journal runs destructive admin operations (redrive, purge) at most
// once per approval across any number of replicas, and resumable after a
// crash, by recording them in messaging_admin_operation.
//
// # Identity: ticket and plan digest
//
// An operation is identified by its approval ticket and its plan digest: hex
// sha256 over the operation name and the canonical JSON of its normalized
// filter ([Digest], [Filter.Normalize]). A different filter is a different
// digest, so an approval cannot be used to run a different plan. In addition a
// unique index on approval_ticket (migration 00011) binds a ticket to exactly
// one plan: beginning a second digest under the same ticket is refused with
// JOURNAL_PLAN_MISMATCH, by the database rather than by a check-then-act.
//
// # Approvals
//
// [Journal.Approve] records an approval in messaging_admin_approval before
// anything runs: the ticket, the operation and plan digest, the approver
// (session_user, set by a trigger: the client cannot name someone else),
// the time, and the row set the approver saw: the highest matching seq and
// the instant of approval (only rows parked before it), with the count as a
// ceiling. Redrive and Purge under a ticket with an approval touch only
// that row set, and refuse with JOURNAL_APPROVAL_EXCEEDED, giving the
// current count, while more rows of it match than were approved; another
// plan under the ticket is JOURNAL_PLAN_MISMATCH. With
// Config.RequireApproval (outboxctl always sets it) a ticket without an
// approval is refused (JOURNAL_NOT_APPROVED). The journal row lists the
// login of every begin and takeover (executed_by) and of every forced
// takeover (forced_by), kept by a trigger.
//
// # Who runs it
//
// [Journal.Begin] inserts the row with INSERT ... ON CONFLICT DO NOTHING:
// exactly one replica wins. The others read the row and are refused with
// JOURNAL_ALREADY_EXECUTED (it is COMPLETED: an approval never runs twice) or
// JOURNAL_IN_FLIGHT (STARTED under another owner's live lease, or under the
// same owner name but another database login: a live operation resumes at
// once only for its owner under the login that last ran it, and for anyone
// else only with Config.ForceTakeover, recorded in forced_by), or take over
// a FAILED or lease-expired operation with a conditional UPDATE ... RETURNING
// that bumps the lease token and that itself matches nothing (again
// JOURNAL_IN_FLIGHT) when another replica took it over, or the owner
// checkpointed, between the read and the update.
//
// # Progress that never goes backwards
//
// Redrive and Purge walk the matching parked rows in seq order (keyset:
// seq > cursor ORDER BY seq LIMIT n). Each batch is one transaction that first
// locks the journal row fenced by owner and lease token, then changes its rows,
// then checkpoints (cursor = last seq, items_completed = GREATEST(old, new))
// and extends the lease. Effect and progress commit together, so after a crash
// the operation resumes exactly after the last committed batch: no row is
// changed twice and none is skipped. An owner whose lease was taken over gets
// JOURNAL_LEASE_LOST and its batch rolls back.
//
// Without an approval, rows that become parked after the operation started
// are included only if
// their seq is past the cursor when the walk reaches them; the plan's count
// (the dry run, [Journal.PlanRedrive]) is a snapshot, not a promise. An
// executing call counts again right after Begin, from the checkpoint it
// resumes at, and reports the items already completed plus that count
// (Progress.Planned), on the same scale as Progress.Items.
//
// # Redrive semantics
//
// A redriven row becomes PENDING with attempts = 0, next_attempt_at = now,
// parked_at and lease owner/expiry cleared. lease_token is kept: it only ever
// grows, so a relay holding an older token stays fenced out.
// last_failure_code and last_failure_detail are kept, so operators can still
// see why a row was parked until its next attempt overwrites them.
//
// Purge deletes the matching parked rows. Neither operation ever touches a
// PENDING, IN_FLIGHT, AMBIGUOUS or PUBLISHED row.
//
// All time-dependent statements take the injectable clock (Config.Now) as
// coalesce($now::timestamptz, now()).
package journal
