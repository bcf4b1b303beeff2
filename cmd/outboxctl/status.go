package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/fencedoutbox/watermill-outbox/status"
)

func (a *app) statusCommand() *cobra.Command {
	var opts status.Options
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Backlog by status, destination and tenant; parked rows and why; stuck flows; live relays; relay mode; CDC slots and their lag",
		Long: `Print the outbox backlog (rows not PUBLISHED) by status, destination and
tenant, the age of the oldest pending row, the AMBIGUOUS / FAILED / EXHAUSTED
counts with their most frequent failure codes, correlation ids with parked or
long-pending rows, the live polling relays and the relay mode, the live CDC
consumers and, per logical replication slot, the WAL it retains, its
confirmed lag, wal_status and safe_wal_size (with a WARNING line for a lost
or unreserved slot and for CDC consumers on more than one slot). Everything
is read in one read-only transaction by bounded, index-served queries (see
status/EXPLAIN.md).`,
		Args: cobra.NoArgs,
		RunE: a.withDB(func(ctx context.Context, db *sql.DB, _ *cobra.Command, _ []string) error {
			snap, err := status.CollectWith(ctx, db, opts)
			if err != nil {
				return err
			}
			if a.json {
				return a.printJSON(snap)
			}
			return a.printStatus(snap)
		}),
	}
	f := cmd.Flags()
	f.DurationVar(&opts.StuckAfter, "stuck-after", status.DefaultStuckAfter, "a correlation id is stuck when one of its rows stays unpublished this long")
	f.IntVar(&opts.MaxGroups, "max-groups", status.DefaultMaxGroups, "most (status, destination, tenant) groups to read")
	f.IntVar(&opts.MaxFailureCodes, "top-failures", status.DefaultMaxFailureCodes, "how many (status, failure code) pairs to show")
	f.IntVar(&opts.MaxStuck, "max-stuck", status.DefaultMaxStuck, "how many stuck correlation ids to show (oldest first)")
	return cmd
}

func (a *app) printStatus(s status.Snapshot) error {
	out := a.stdout
	fmt.Fprintf(out, "relay mode:   %s (since %s by %s)\n", s.Mode, cell(s.ModeChangedAt), cell(s.ModeChangedBy))
	fmt.Fprintf(out, "unpublished:  %d (every status but PUBLISHED)\n", s.Unpublished)
	age := "-"
	if !s.OldestPendingAt.IsZero() {
		age = cell(time.Duration(s.OldestPendingAgeSeconds*float64(time.Second))) + " (created " + cell(s.OldestPendingAt) + ")"
	}
	fmt.Fprintf(out, "in transit:   %d (PENDING, IN_FLIGHT, AMBIGUOUS), oldest %s\n", s.Pending, age)
	fmt.Fprintf(out, "ambiguous:    %d\nfailed:       %d\nexhausted:    %d\n", s.Ambiguous, s.Failed, s.Exhausted)
	if s.Truncated {
		fmt.Fprintln(out, "(backlog groups truncated at --max-groups; totals cover the groups read)")
	}

	section(out, "BACKLOG")
	t := newTable(out)
	t.row("STATUS", "DESTINATION", "TENANT", "COUNT", "OLDEST")
	for _, g := range s.Groups {
		t.row(string(g.Status), g.Destination, g.Tenant, g.Count, g.Oldest)
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, c := range []struct {
		title  string
		counts []status.Count
	}{{"BY DESTINATION", s.ByDestination}, {"BY TENANT", s.ByTenant}} {
		section(out, c.title)
		t = newTable(out)
		t.row("KEY", "COUNT")
		for _, n := range c.counts {
			t.row(n.Key, n.Count)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}

	section(out, "TOP FAILURE CODES")
	t = newTable(out)
	t.row("STATUS", "CODE", "COUNT")
	for _, f := range s.FailureCodes {
		t.row(string(f.Status), f.Code, f.Count)
	}
	if err := t.flush(); err != nil {
		return err
	}

	section(out, fmt.Sprintf("STUCK CORRELATIONS (parked, or unpublished for more than %s)", time.Duration(s.StuckAfterSeconds*float64(time.Second))))
	t = newTable(out)
	t.row("CORRELATION_ID", "PARKED", "LONG_PENDING", "OLDEST")
	for _, c := range s.StuckCorrelations {
		t.row(c.CorrelationID, c.Parked, c.LongPending, c.Oldest)
	}
	if err := t.flush(); err != nil {
		return err
	}
	if more := s.StuckTotal - int64(len(s.StuckCorrelations)); more > 0 {
		fmt.Fprintf(out, "... and %d more (--max-stuck shows more)\n", more)
	}

	section(out, "OPEN BREAKERS (destinations a relay found unavailable; their rows wait without spending attempts)")
	t = newTable(out)
	t.row("DESTINATION", "OWNER", "OPENED", "LAST_ERROR")
	for _, b := range s.Breakers {
		t.row(b.Destination, b.Owner, b.OpenedAt, b.LastError)
	}
	if err := t.flush(); err != nil {
		return err
	}

	section(out, "LIVE RELAYS")
	t = newTable(out)
	t.row("OWNER", "STARTED", "HEARTBEAT", "EXPIRES", "MAX_ATTEMPTS")
	for _, r := range s.Relays {
		budget := any(r.MaxAttempts)
		if r.MaxAttempts == 0 {
			budget = "-"
		}
		t.row(r.Owner, r.StartedAt, r.HeartbeatAt, r.ExpiresAt, budget)
	}
	if err := t.flush(); err != nil {
		return err
	}
	if s.BudgetsDiffer {
		fmt.Fprintln(out, "warning: live relays have different MaxAttempts: the budget is each relay's configuration, not the row's, so the lowest parks the others' rows EXHAUSTED; give every replica the same")
	}

	section(out, "LANES (fence "+s.Fence+")")
	t = newTable(out)
	t.row("LANE", "OWNER", "EPOCH", "EXPIRES", "IN_FLIGHT")
	for _, l := range s.Lanes {
		if l.Owner == "" && l.InFlight == 0 && s.Fence != "LANES" {
			continue // per-row scheme: the lanes are unused
		}
		owner, expires := l.Owner, any("-")
		if owner == "" {
			owner = "-"
		}
		if l.ExpiresAt != nil {
			expires = *l.ExpiresAt
			if !l.Live {
				owner += " (expired)"
			}
		}
		t.row(l.Lane, owner, l.Epoch, expires, l.InFlight)
	}
	if err := t.flush(); err != nil {
		return err
	}

	section(out, "CDC CONSUMERS")
	t = newTable(out)
	t.row("OWNER", "SLOT", "STARTED", "HEARTBEAT", "EXPIRES")
	for _, r := range s.CDCConsumers {
		t.row(r.Owner, r.SlotName, r.StartedAt, r.HeartbeatAt, r.ExpiresAt)
	}
	if err := t.flush(); err != nil {
		return err
	}

	section(out, "REPLICATION SLOTS (retained WAL, confirmed lag, WAL left before the slot may be lost)")
	t = newTable(out)
	t.row("SLOT", "ACTIVE", "WAL_STATUS", "RETAINED_WAL", "CONFIRMED_LAG", "SAFE_WAL_SIZE", "OLDER_UNDELIVERED")
	for _, sl := range s.Slots {
		safe := "unlimited"
		if sl.SafeWALSizeBytes != nil {
			safe = bytesCell(*sl.SafeWALSizeBytes)
		}
		older := "unknown"
		if sl.UndeliveredBeforeSlot != nil {
			older = fmt.Sprint(*sl.UndeliveredBeforeSlot)
		}
		t.row(sl.Name, sl.Active, sl.WALStatus, bytesCell(sl.RetainedWALBytes), bytesCell(sl.ConfirmedLagBytes), safe, older)
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, w := range s.Warnings {
		fmt.Fprintf(out, "WARNING: %s\n", w)
	}
	return nil
}

// bytesCell is a byte count as operators read WAL sizes: exact below 1 KiB,
// then KiB/MiB/GiB with one decimal, and the exact count in parentheses.
func bytesCell(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, suffix := float64(n)/unit, "KiB"
	for _, s := range []string{"MiB", "GiB", "TiB"} {
		if v < unit {
			break
		}
		v, suffix = v/unit, s
	}
	return fmt.Sprintf("%.1f %s (%d)", v, suffix, n)
}
