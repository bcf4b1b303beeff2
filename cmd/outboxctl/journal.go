package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/signal"
	"os/user"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// CodeDigestMismatch: --expect-digest differs from the digest of the plan
// the flags describe (the operator approved a different plan).
const CodeDigestMismatch outbox.Code = "OUTBOXCTL_DIGEST_MISMATCH"

// CodeDigestRequired: an execution without --expect-digest (the digest of
// the approved dry run).
const CodeDigestRequired outbox.Code = "OUTBOXCTL_DIGEST_REQUIRED"

// CodeInterrupted: an execution that began was cut (a signal, a lost
// connection, a failed batch); the detail names the items done and the
// command that resumes it from its checkpoint.
const CodeInterrupted outbox.Code = "OUTBOXCTL_OPERATION_INTERRUPTED"

// ErrDigestMismatch matches CodeDigestMismatch with errors.Is.
var ErrDigestMismatch = &outbox.Error{Code: CodeDigestMismatch}

func init() {
	for _, c := range []outbox.Code{journal.CodeAlreadyExecuted, journal.CodeInFlight, journal.CodeLeaseLost,
		journal.CodePlanMismatch, CodeDigestMismatch, journal.CodeNotApproved, journal.CodeApprovalExceeded,
		journal.CodeAlreadyApproved} {
		guardCodes[c] = true
	}
	for _, c := range []outbox.Code{journal.CodeInvalidFilter, journal.CodeTicketRequired, CodeDigestRequired} {
		usageCodes[c] = true
	}
}

// journalFlags are the flags redrive and purge share.
type journalFlags struct {
	statuses     []string
	destination  string
	tenant       string
	failureCode  string
	messageIDs   []string
	since, until string
	ticket       string
	dryRun       bool
	expectDigest string
	batchSize    int
	owner        string
	approve      bool
	force        bool
}

func (f *journalFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringArrayVar(&f.statuses, "status", nil, "EXHAUSTED or FAILED (repeatable; default both)")
	fl.StringVar(&f.destination, "destination", "", "only rows of this destination")
	fl.StringVar(&f.tenant, "tenant", "", "only rows of this tenant")
	fl.StringVar(&f.failureCode, "failure-code", "", "only rows whose last_failure_code is this")
	fl.StringArrayVar(&f.messageIDs, "message-id", nil, "only these message ids (repeatable)")
	fl.StringVar(&f.since, "since", "", "only rows created at or after this RFC 3339 time")
	fl.StringVar(&f.until, "until", "", "only rows created before this RFC 3339 time")
	fl.StringVar(&f.ticket, "ticket", "", "approval ticket; required to execute (the same ticket never runs twice, nor a different plan)")
	fl.BoolVar(&f.dryRun, "dry-run", false, "print the plan, the matching count and its digest; change nothing")
	fl.StringVar(&f.expectDigest, "expect-digest", "", "the digest of the approved dry run; required to execute, refused (exit 3) when the flags describe another plan")
	fl.IntVar(&f.batchSize, "batch-size", journal.DefaultBatchSize, "rows per batch (one transaction with its checkpoint)")
	fl.BoolVar(&f.approve, "approve", false, "record the approval of this plan under --ticket (needs --expect-digest, the reviewed dry run's digest): the approver is your database login, and the rows matching now, with their count as a ceiling, are what the execution may touch")
	fl.BoolVar(&f.force, "force-takeover", false, "take over the ticket's operation although its lease is live (another process may still be running it); recorded in the journal with your login")
	fl.StringVar(&f.owner, "owner", "", "journal owner of this run (default outboxctl:<user>@<host>:<ticket>: the same operator re-running the same command resumes it at once; an operation left by another owner resumes with that --owner, or by anyone once its lease ends)")
}

// filter turns the flags into a journal.Filter. Times are absolute (RFC
// 3339) on purpose: a relative "24h ago" would give a different plan digest
// on every run, so a dry run's digest could never match its execution.
func (f *journalFlags) filter() (journal.Filter, error) {
	var jf journal.Filter
	for _, s := range f.statuses {
		jf.Statuses = append(jf.Statuses, envelope.Status(strings.ToUpper(strings.TrimSpace(s))))
	}
	jf.Destination, jf.Tenant, jf.FailureCode, jf.MessageIDs = f.destination, f.tenant, f.failureCode, f.messageIDs
	for _, t := range []struct {
		flag, value string
		into        *time.Time
	}{{"--since", f.since, &jf.CreatedAfter}, {"--until", f.until, &jf.CreatedBefore}} {
		if t.value == "" {
			continue
		}
		v, err := time.Parse(time.RFC3339Nano, t.value)
		if err != nil {
			return jf, outbox.Errorf(CodeUsage, "outboxctl", "%s %q is not an RFC 3339 time (e.g. 2030-01-02T15:04:05Z)", t.flag, t.value)
		}
		*t.into = v
	}
	return jf, jf.Validate()
}

func (a *app) redriveCommand() *cobra.Command {
	return a.journalCommand(journal.OpRedrive,
		"Move parked rows (EXHAUSTED/FAILED) matching the filter back to PENDING, once per approval ticket",
		`Redrive parked rows matching the filter back to PENDING (attempts reset,
next_attempt_at now), through the admin journal: an approval ticket runs once
across all replicas, resumes from its checkpoint after a crash, and cannot run
a different plan. --dry-run prints the plan, the matching count and the plan
digest and changes nothing. Progress is printed per batch on stderr.`)
}

func (a *app) purgeCommand() *cobra.Command {
	return a.journalCommand(journal.OpPurge,
		"Delete parked rows (EXHAUSTED/FAILED) matching the filter, once per approval ticket",
		`Delete parked rows matching the filter through the admin journal, with the
same guarantees and flags as redrive. Only FAILED and EXHAUSTED rows are ever
touched.`)
}

func (a *app) journalCommand(op, short, long string) *cobra.Command {
	var f journalFlags
	cmd := &cobra.Command{
		Use:   op,
		Short: short,
		Long:  long + strings.ReplaceAll(journalLong, "<op>", op),
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			body := a.withDBCtx(true, func(ctx context.Context, db *sql.DB, _ *cobra.Command, _ []string) error {
				return a.journalRun(ctx, db, op, &f)
			})
			if f.dryRun {
				// A dry run is a read: --timeout bounds it like any command.
				return a.runE(body)(cmd, args)
			}
			// An execution is not cut by --timeout: it runs to completion
			// or until SIGINT/SIGTERM, and a cut is reported with the
			// ticket, the items done and the command that resumes it.
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			if err := body(ctx, cmd, args); err != nil {
				return runError{err}
			}
			return nil
		},
	}
	f.register(cmd)
	return cmd
}

const journalLong = `

Runbook: plan, approve, execute.
  1. outboxctl <op> <filter> --dry-run      prints the plan, the matching count and its digest
  2. the approver reviews that output and records the approval in the database:
     outboxctl <op> <filter> --ticket T --expect-digest D --approve
     (the approver is the database login; the rows matching now and their
     count are what the execution may touch)
  3. outboxctl <op> <filter> --ticket T --expect-digest D
Execution requires --ticket, --expect-digest and a recorded approval of that
plan under that ticket (exit 3 otherwise); rows parked after the approval are
left alone, and more matching rows than approved is refused (exit 3) with the
count. Flags that describe a different plan are refused (exit 3) with the
digest they describe.

An execution is not bounded by --timeout (a dry run is). If it is cut (a
signal, a lost connection, a failed batch) it reports the ticket, the items
done and the exact command that resumes it from its checkpoint. The journal
owner defaults to outboxctl:<user>@<host>:<ticket>, the same for the same
operator and ticket, so re-running the same command resumes at once; another
owner is refused (exit 3) until the lease ends, and told when that is. An
execution that matches no rows completes, and so consumes its ticket.`

// defaultJournalOwner is the journal owner of an execution without --owner:
// stable for the same operator (OS user and host) and ticket, so the same
// operator re-running the same command resumes an operation a killed run
// left STARTED, without waiting out its lease.
func defaultJournalOwner(ticket string) string {
	name := os.Getenv("USER")
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	if name == "" {
		name = fmt.Sprintf("uid%d", os.Getuid())
	}
	host, _ := os.Hostname()
	return fmt.Sprintf("outboxctl:%s@%s:%s", name, host, ticket)
}

func (a *app) journalRun(ctx context.Context, db *sql.DB, op string, f *journalFlags) error {
	filter, err := f.filter()
	if err != nil {
		return err
	}
	if !f.dryRun && f.ticket == "" {
		return outbox.Errorf(journal.CodeTicketRequired, "outboxctl "+op, "--ticket is required to approve or execute (or use --dry-run to see the plan)")
	}
	if f.dryRun && (f.approve || f.force) {
		return outbox.Errorf(CodeUsage, "outboxctl "+op, "--dry-run changes nothing: it takes neither --approve nor --force-takeover")
	}
	owner := f.owner
	if owner == "" && !f.dryRun {
		owner = defaultJournalOwner(f.ticket)
	}
	j, err := journal.New(db, journal.Config{BatchSize: f.batchSize, Owner: owner, RequireApproval: true, ForceTakeover: f.force})
	if err != nil {
		return err
	}
	planFn, runFn := j.PlanRedrive, j.Redrive
	if op == journal.OpPurge {
		planFn, runFn = j.PlanPurge, j.Purge
	}
	if f.dryRun {
		plan, err := planFn(ctx, filter)
		if err != nil {
			return err
		}
		if a.json {
			return a.printJSON(map[string]any{"dry_run": true, "plan": planJSON(plan)})
		}
		return a.printPlan(plan, true, f)
	}
	// The digest depends on the operation and filter only, so the approval
	// check needs no database; the count is the journal's own, taken when
	// it runs.
	digest, _, err := journal.Digest(op, filter)
	if err != nil {
		return err
	}
	if f.expectDigest == "" {
		return outbox.Errorf(CodeDigestRequired, "outboxctl "+op,
			"--expect-digest is required to execute: run with --dry-run, have the printed plan and digest approved under the ticket, then execute with --ticket %s --expect-digest <approved digest>", f.ticket)
	}
	if f.expectDigest != digest {
		return outbox.Errorf(CodeDigestMismatch, "outboxctl "+op, "the flags describe plan %s, not the approved %s: run --dry-run with these flags and get that plan approved, or use the flags of the approved plan", digest, f.expectDigest)
	}
	if f.approve {
		return a.approve(ctx, j, op, filter, f)
	}
	// Refused before the plan is printed: nothing runs without an approval
	// (the journal checks again, and binds the approved rows, when it runs).
	if _, err := j.FindApproval(ctx, f.ticket); outbox.CodeOf(err) == journal.CodeNotApproved {
		return outbox.Errorf(journal.CodeNotApproved, "outboxctl "+op,
			"ticket %s has no recorded approval: the approver reviews the --dry-run and records it with: %s --approve", f.ticket, f.command(op, digest, f.ticket, ""))
	} else if err != nil {
		return err
	}
	if !a.json {
		// The operator sees the plan before it runs, so the human output
		// keeps this pre-run count (the journal counts again).
		plan, err := planFn(ctx, filter)
		if err != nil {
			return err
		}
		if err := a.printPlan(plan, false, f); err != nil {
			return err
		}
	}
	out, err := runFn(ctx, f.ticket, filter, journal.Options{Progress: func(p journal.Progress) error {
		a.progress("%s %s: batch %d committed, %d of %d items", p.Operation, p.Ticket, p.Batch, p.Items, p.Planned)
		return nil
	}})
	if err != nil {
		return a.journalError(ctx, j, op, f, digest, owner, out, err)
	}
	matchedNone := out.Items == 0 && out.Plan.Matching == 0
	if a.json {
		return a.printJSON(map[string]any{"dry_run": false, "plan": planJSON(out.Plan), "ticket": f.ticket,
			"batches": out.Batches, "items": out.Items, "owner": out.Run.Owner, "matched_none": matchedNone, "ticket_consumed": true})
	}
	if matchedNone {
		fmt.Fprintf(a.stdout, "\n%s matched no rows: ticket %s is consumed (recorded COMPLETED with 0 items) and cannot run again; a later %s needs a new approval\n", op, f.ticket, op)
		return nil
	}
	// The journal's totals, like the progress lines: on a resumed ticket
	// they count the items earlier runs did, which the plan printed above
	// (rows matching now) does not.
	batches := "batches"
	if out.Batches == 1 {
		batches = "batch"
	}
	fmt.Fprintf(a.stdout, "\n%s complete under ticket %s: %d of %d items (%d %s in this run)\n", op, f.ticket, out.Items, out.Plan.Matching, out.Batches, batches)
	return nil
}

// journalError turns an execution's error into one an operator can act on.
// A run that began and was cut (a signal, a lost connection, a failed
// batch) becomes OUTBOXCTL_OPERATION_INTERRUPTED with the items done and
// the command that resumes it; JOURNAL_IN_FLIGHT gets the holder, when its
// lease ends, and the commands that resume it now or then.
func (a *app) journalError(ctx context.Context, j *journal.Journal, op string, f *journalFlags, digest, owner string, out journal.Outcome, err error) error {
	switch code := outbox.CodeOf(err); {
	case code == journal.CodeInFlight:
		rec, ferr := j.Find(context.WithoutCancel(ctx), f.ticket)
		if ferr != nil || rec.State != journal.StateStarted {
			return err
		}
		ends := rec.LeaseExpiresAt.UTC().Format(time.RFC3339)
		cmd := f.command(op, digest, f.ticket, rec.Owner)
		login := "?"
		if len(rec.ExecutedBy) > 0 {
			login = rec.ExecutedBy[len(rec.ExecutedBy)-1]
		}
		return &resumeError{cause: err, resume: cmd, err: outbox.Errorf(journal.CodeInFlight, "outboxctl "+op,
			"owner %s (database login %s) holds ticket %s (%s done) until %s. If that process is still running, let it finish; if it is gone, run this command again after %s; that login resumes it now as that owner with: %s (any other login only with --force-takeover, which is recorded)",
			rec.Owner, login, f.ticket, items(rec.ItemsCompleted), ends, ends, cmd)}
	case out.Run == nil, code == journal.CodeLeaseLost:
		// Refused before it began, or another owner took it over: nothing
		// of ours to resume.
		return err
	}
	cmd := f.command(op, digest, f.ticket, owner)
	return &resumeError{cause: err, resume: cmd, err: outbox.Errorf(CodeInterrupted, "outboxctl "+op,
		"%s under ticket %s stopped after %s (%v); its checkpoint is kept, so nothing is lost or done twice; resume it from there with: %s",
		op, f.ticket, items(out.Items), err, cmd)}
}

// items is "1 item" or "n items".
func items(n int64) string {
	if n == 1 {
		return "1 item"
	}
	return fmt.Sprintf("%d items", n)
}

// resumeError carries the command that resumes an operation (printed as
// "resume" with --json).
// Its text ends with that command, so it can be copied from the end of the
// line; the underlying cause stays in the chain for errors.Is.
type resumeError struct {
	err    *outbox.Error // the code and the text, ending with the command
	cause  error
	resume string
}

func (e *resumeError) Error() string   { return e.err.Error() }
func (e *resumeError) Unwrap() []error { return []error{e.err, e.cause} }

// command is the outboxctl command line of this plan under ticket with
// digest (and --owner when owner is set), shell-quoted, without the
// database URL (give it as before, e.g. in OUTBOX_DATABASE_URL). An empty
// ticket is written <ticket>.
func (f *journalFlags) command(op, digest, ticket, owner string) string {
	parts := []string{"outboxctl", op}
	for _, s := range f.statuses {
		parts = append(parts, "--status", shellQuote(s))
	}
	for _, kv := range [][2]string{{"--destination", f.destination}, {"--tenant", f.tenant}, {"--failure-code", f.failureCode}} {
		if kv[1] != "" {
			parts = append(parts, kv[0], shellQuote(kv[1]))
		}
	}
	for _, id := range f.messageIDs {
		parts = append(parts, "--message-id", shellQuote(id))
	}
	for _, kv := range [][2]string{{"--since", f.since}, {"--until", f.until}} {
		if kv[1] != "" {
			parts = append(parts, kv[0], shellQuote(kv[1]))
		}
	}
	if f.batchSize != journal.DefaultBatchSize {
		parts = append(parts, "--batch-size", fmt.Sprint(f.batchSize))
	}
	t := "<ticket>"
	if ticket != "" {
		t = shellQuote(ticket)
	}
	parts = append(parts, "--ticket", t, "--expect-digest", digest)
	if owner != "" {
		parts = append(parts, "--owner", shellQuote(owner))
	}
	return strings.Join(parts, " ")
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.:/@+=,", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
