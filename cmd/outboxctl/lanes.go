package main

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// lanesCommand is `outboxctl lanes set N`: the lane fence's one-time step
// (docs/FENCE.md).
func (a *app) lanesCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "lanes",
		Short: "Set up the lane fence: the number of lanes and their index (docs/FENCE.md)",
	}
	var maxAttempts int
	set := &cobra.Command{
		Use:   "set N",
		Short: "Set the number of lanes to N and (re)build the lanes' index; refused while a lane is owned",
		Long: `Set the number of lanes to N (1-4096) and build the lanes' index,
messaging_outbox_lane_idx, which relays started with --fence lanes need
(migration 00050 creates 32 lanes but not the index: it would cost every
insert of a fleet on per-row leases an index entry). Refused with
LANES_BUSY while any lane is owned under a live lease: stop the lane relays
first. What expired owners left in flight is charged an attempt (parked
EXHAUSTED at --max-attempts). The index is built inside the transaction and
blocks writes to the outbox while it runs: do it in a quiet period. Run it
with the migrate login.`,
		Args: cobra.ExactArgs(1),
		RunE: a.runE(a.withDBCtx(true, func(ctx context.Context, db *sql.DB, _ *cobra.Command, args []string) error {
			n, err := strconv.Atoi(args[0])
			if err != nil || n < 1 || n > fencing.MaxLanes {
				return outbox.Errorf(CodeUsage, "outboxctl lanes set", "N must be a number of lanes between 1 and %d, got %q", fencing.MaxLanes, args[0])
			}
			if maxAttempts < 1 {
				return outbox.Errorf(CodeUsage, "outboxctl lanes set", "--max-attempts must be at least 1, got %d", maxAttempts)
			}
			if err := fencing.SetLaneCount(ctx, db, n, maxAttempts); err != nil {
				return err
			}
			if a.json {
				return a.printJSON(map[string]any{"lanes": n, "index": "messaging_outbox_lane_idx"})
			}
			fmt.Fprintf(a.stdout, "lanes: %d (index messaging_outbox_lane_idx built)\n", n)
			return nil
		})),
	}
	set.Flags().IntVar(&maxAttempts, "max-attempts", forwarder.DefaultMaxAttempts, "the relays' attempt budget: rows an expired owner left in flight are parked EXHAUSTED when their charged attempt reaches it")
	cmd.AddCommand(set)
	return cmd
}
