package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

func (a *app) cleanupCommand() *cobra.Command {
	var (
		cfg         retention.Config
		byCreatedAt bool
	)
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Run retention once: delete (or archive) old rows in bounded batches",
		Long: fmt.Sprintf(`Run one retention pass: remove PUBLISHED rows whose published_at is past the
horizon, in batches of --batch-size rows, at most --max-batches batches, each
batch in its own transaction under its own statement timeout. Parked and
pending rows are never touched. --archive moves rows to
messaging_outbox_archive instead of deleting them.

In CDC relay mode nothing marks rows PUBLISHED, so retention goes by
created_at instead: --by-created-at, which removes rows of ANY status past the
horizon. It is refused unless the database's relay mode is CDC (exit 3).
Horizons below the floors (--horizon %s, --inbox-horizon %s: the
brokers' default redelivery window) are refused unless --allow-short-horizons
is given, which is printed as a warning. A run that finds another session
holding the retention lock removes nothing and exits 5, naming that session.
Progress is printed per batch on stderr.`, retention.DefaultHorizon, retention.MinInboxHorizon),
		Args: cobra.NoArgs,
		RunE: a.withDB(func(ctx context.Context, db *sql.DB, cmd *cobra.Command, _ []string) error {
			// Zero would quietly mean the library's default; on the command
			// line the default is leaving the flag out.
			for _, z := range []struct {
				flag string
				zero bool
			}{{"horizon", cfg.Horizon == 0}, {"batch-size", cfg.BatchSize == 0}, {"max-batches", cfg.MaxBatches == 0}, {"statement-timeout", cfg.StatementTimeout == 0}} {
				if z.zero && cmd.Flags().Changed(z.flag) {
					return outbox.Errorf(CodeUsage, "outboxctl cleanup", "--%s is 0; give a positive value, or leave the flag out for its default", z.flag)
				}
			}
			if byCreatedAt {
				// The Cleaner reads the relay mode itself and refuses outside
				// CDC mode; the CLI only names that refusal its own way.
				cfg.Mode = retention.ByCreatedAt
			} else {
				mode, err := relaymode.CurrentMode(ctx, db)
				if err != nil {
					return err
				}
				if mode == relaymode.ModeCDC {
					a.progress("warning: relay mode is CDC: rows are never marked PUBLISHED, so this run removes nothing; use --by-created-at")
				}
			}
			if cfg.AllowShortHorizons && (cfg.Horizon < retention.DefaultHorizon || (cfg.InboxHorizon > 0 && cfg.InboxHorizon < retention.MinInboxHorizon)) {
				a.progress("warning: --allow-short-horizons: horizon %s (floor %s), inbox horizon %s (floor %s)",
					cfg.Horizon, retention.DefaultHorizon, cfg.InboxHorizon, retention.MinInboxHorizon)
			}
			cfg.OnBatch = func(b retention.Batch) {
				a.progress("batch %d on %s: %d rows", b.Number, b.Table, b.Removed)
			}
			c, err := retention.New(db, nil, cfg)
			if err != nil {
				return err
			}
			res, err := c.Run(ctx)
			if errors.Is(err, relaymode.ErrRelayModeConflict) {
				return outbox.Wrap(CodeRetentionMode, "outboxctl cleanup", err,
					"--by-created-at removes rows of any status and is for CDC relay mode only")
			}
			if err != nil {
				return err
			}
			skipped := outbox.Errorf(CodeCleanupSkipped, "outboxctl cleanup",
				"skipped: another session holds the retention lock (%s); retention does not run while it does", cmp.Or(res.HeldBy, "holder not visible"))
			if a.json {
				if err := a.printJSON(map[string]any{
					"skipped": res.Skipped, "held_by": res.HeldBy, "batches": res.Batches, "deleted": res.Deleted, "archived": res.Archived,
					"archive_duplicates": res.ArchiveDuplicates, "archive_conflicts": res.ArchiveConflicts,
					"inbox_batches": res.InboxBatches, "inbox_deleted": res.InboxDeleted, "more": res.More,
					"duration_seconds": res.Duration.Seconds(), "mode": string(c.Config().Mode),
				}); err != nil || !res.Skipped {
					return err
				}
				return skipped
			}
			if res.Skipped {
				return skipped
			}
			t := newTable(a.stdout)
			t.row("mode", string(c.Config().Mode))
			t.row("batches", res.Batches)
			t.row("deleted", res.Deleted)
			t.row("archived", res.Archived)
			if c.Config().Archive {
				// Ids already in the archive: the same message (deleted from the
				// outbox, counted in archived) or a different one (left in the
				// outbox, marked RETENTION_ARCHIVE_CONFLICT).
				t.row("archive duplicates", res.ArchiveDuplicates)
				t.row("archive conflicts", res.ArchiveConflicts)
			}
			t.row("inbox batches", res.InboxBatches)
			t.row("inbox deleted", res.InboxDeleted)
			t.row("more past horizon", res.More)
			t.row("duration", res.Duration)
			return t.flush()
		}),
	}
	f := cmd.Flags()
	f.DurationVar(&cfg.Horizon, "horizon", retention.DefaultHorizon, "remove rows older than this")
	f.IntVar(&cfg.BatchSize, "batch-size", retention.DefaultBatchSize, "rows per batch (one transaction)")
	f.IntVar(&cfg.MaxBatches, "max-batches", retention.DefaultMaxBatches, "most batches in this run, per table")
	f.DurationVar(&cfg.StatementTimeout, "statement-timeout", retention.DefaultStatementTimeout, "statement timeout of each batch")
	f.BoolVar(&cfg.Archive, "archive", false, "move rows to messaging_outbox_archive instead of deleting them")
	f.DurationVar(&cfg.InboxHorizon, "inbox-horizon", 0, "also remove inbox rows processed longer ago than this (0 = leave the inbox alone)")
	f.BoolVar(&cfg.AllowShortHorizons, "allow-short-horizons", false, fmt.Sprintf("allow --horizon below %s and --inbox-horizon below %s (logged)", retention.DefaultHorizon, retention.MinInboxHorizon))
	f.BoolVar(&byCreatedAt, "by-created-at", false, "CDC mode: remove rows by created_at whatever their status (refused unless the relay mode is CDC)")
	return cmd
}
