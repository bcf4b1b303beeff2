package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/fencedoutbox/watermill-outbox/journal"
)

// approve records the approval of the plan under f.ticket and prints it.
func (a *app) approve(ctx context.Context, j *journal.Journal, op string, filter journal.Filter, f *journalFlags) error {
	ap, err := j.Approve(ctx, f.ticket, op, filter)
	if err != nil {
		return err
	}
	if a.json {
		return a.printJSON(map[string]any{"approved": true, "ticket": ap.Ticket, "operation": ap.Operation, "digest": ap.Digest,
			"approved_count": ap.Count, "max_seq": ap.MaxSeq, "parked_before": ap.ParkedBefore.UTC().Format(time.RFC3339Nano),
			"approved_by": ap.ApprovedBy, "approved_at": ap.ApprovedAt.UTC().Format(time.RFC3339Nano)})
	}
	t := newTable(a.stdout)
	t.row("ticket", ap.Ticket)
	t.row("operation", ap.Operation)
	t.row("digest", ap.Digest)
	t.row("approved count", ap.Count)
	t.row("highest seq", ap.MaxSeq)
	t.row("parked before", ap.ParkedBefore.UTC().Format(time.RFC3339))
	t.row("approved by", ap.ApprovedBy)
	if err := t.flush(); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "\napproved: at most these %d rows may be touched; execute with:\n  %s\n", ap.Count, f.command(op, ap.Digest, f.ticket, f.owner))
	return nil
}

func planJSON(p journal.Plan) map[string]any {
	return map[string]any{"operation": p.Operation, "filter": p.Filter, "digest": p.Digest, "matching": p.Matching}
}

func (a *app) printPlan(p journal.Plan, dryRun bool, f *journalFlags) error {
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
		fmt.Fprintf(a.stdout, "\ndry run: nothing changed; once this plan is approved, execute it with:\n  %s\n", f.command(p.Operation, p.Digest, f.ticket, f.owner))
	}
	return nil
}
