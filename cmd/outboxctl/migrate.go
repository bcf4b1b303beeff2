package main

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/fencedoutbox/watermill-outbox/migrations"
)

func (a *app) migrateCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Apply the embedded schema migrations and print the versions applied",
		Long: `Apply every pending embedded migration under the migrations advisory lock
(two concurrent runs serialise; the second applies nothing). Objects are
created in the first schema of the connection's search_path.`,
		Args: cobra.NoArgs,
		RunE: a.runE(a.withDBCtx(false, func(ctx context.Context, db *sql.DB, _ *cobra.Command, _ []string) error {
			res, err := migrations.Up(ctx, db)
			if err != nil {
				return err
			}
			if res.Applied == nil {
				res.Applied = []int64{}
			}
			if a.json {
				return a.printJSON(map[string]any{"applied": res.Applied, "current": res.Current})
			}
			if len(res.Applied) == 0 {
				fmt.Fprintf(a.stdout, "schema up to date at version %d\n", res.Current)
				return nil
			}
			for _, v := range res.Applied {
				fmt.Fprintf(a.stdout, "applied %05d\n", v)
			}
			fmt.Fprintf(a.stdout, "schema at version %d\n", res.Current)
			return nil
		})),
	}
}
