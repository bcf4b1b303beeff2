package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// CodeDigestMismatch: --expect-digest differs from the digest of the plan
// the flags describe (the operator approved a different plan).
const CodeDigestMismatch outbox.Code = "OUTBOXCTL_DIGEST_MISMATCH"

// ErrDigestMismatch matches CodeDigestMismatch with errors.Is.
var ErrDigestMismatch = &outbox.Error{Code: CodeDigestMismatch}

func init() {
	for _, c := range []outbox.Code{journal.CodeAlreadyExecuted, journal.CodeInFlight, journal.CodeLeaseLost,
		journal.CodePlanMismatch, CodeDigestMismatch} {
		guardCodes[c] = true
	}
	for _, c := range []outbox.Code{journal.CodeInvalidFilter, journal.CodeTicketRequired} {
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
	fl.StringVar(&f.expectDigest, "expect-digest", "", "refuse (exit 3) unless the plan's digest is this one (the digest the approver saw in the dry run)")
	fl.IntVar(&f.batchSize, "batch-size", journal.DefaultBatchSize, "rows per batch (one transaction with its checkpoint)")
	fl.StringVar(&f.owner, "owner", "", "journal owner of this run (default host-pid-random)")
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
digest and changes nothing; --ticket is required to execute. Progress is
printed per batch on stderr.`)
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
		Long:  long,
		Args:  cobra.NoArgs,
		RunE: a.withDB(func(ctx context.Context, db *sql.DB, _ *cobra.Command, _ []string) error {
			filter, err := f.filter()
			if err != nil {
				return err
			}
			if !f.dryRun && f.ticket == "" {
				return outbox.Errorf(journal.CodeTicketRequired, "outboxctl "+op, "--ticket is required to execute (or use --dry-run to see the plan)")
			}
			j, err := journal.New(db, journal.Config{BatchSize: f.batchSize, Owner: f.owner})
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
				return a.printPlan(plan, true)
			}
			// The digest depends on the operation and filter only, so the
			// approval check needs no database; the count is the journal's
			// own, taken when it runs.
			digest, _, err := journal.Digest(op, filter)
			if err != nil {
				return err
			}
			if f.expectDigest != "" && f.expectDigest != digest {
				return outbox.Errorf(CodeDigestMismatch, "outboxctl "+op, "the flags describe plan %s, not the approved %s", digest, f.expectDigest)
			}
			if !a.json {
				// The operator sees the plan before it runs, so the human
				// output keeps this pre-run count (the journal counts again).
				plan, err := planFn(ctx, filter)
				if err != nil {
					return err
				}
				if err := a.printPlan(plan, false); err != nil {
					return err
				}
			}
			out, err := runFn(ctx, f.ticket, filter, journal.Options{Progress: func(p journal.Progress) error {
				a.progress("%s %s: batch %d committed, %d of %d items", p.Operation, p.Ticket, p.Batch, p.Items, p.Planned)
				return nil
			}})
			if err != nil {
				return err
			}
			if a.json {
				return a.printJSON(map[string]any{"dry_run": false, "plan": planJSON(out.Plan), "ticket": f.ticket,
					"batches": out.Batches, "items": out.Items, "owner": out.Run.Owner})
			}
			// The journal's totals, like the progress lines: on a resumed
			// ticket they count the items earlier runs did, which the plan
			// printed above (rows matching now) does not.
			batches := "batches"
			if out.Batches == 1 {
				batches = "batch"
			}
			fmt.Fprintf(a.stdout, "\n%s complete under ticket %s: %d of %d items (%d %s in this run)\n", op, f.ticket, out.Items, out.Plan.Matching, out.Batches, batches)
			return nil
		}),
	}
	f.register(cmd)
	return cmd
}

func planJSON(p journal.Plan) map[string]any {
	return map[string]any{"operation": p.Operation, "filter": p.Filter, "digest": p.Digest, "matching": p.Matching}
}

func (a *app) printPlan(p journal.Plan, dryRun bool) error {
	filter, err := json.Marshal(p.Filter)
	if err != nil {
		return err
	}
	t := newTable(a.stdout)
	t.row("operation", p.Operation)
	t.row("filter", string(filter))
	t.row("matching", p.Matching)
	t.row("digest", p.Digest)
	if err := t.flush(); err != nil {
		return err
	}
	if dryRun {
		fmt.Fprintf(a.stdout, "\ndry run: nothing changed; execute with --ticket <approval> --expect-digest %s\n", p.Digest)
	}
	return nil
}
