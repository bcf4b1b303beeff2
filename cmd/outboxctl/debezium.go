package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/user"
	"time"

	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func (a *app) debeziumCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "debezium",
		Short: "CDC relay mode: generate the connector config, switch the relay mode, show it",
	}
	cmd.AddCommand(a.debeziumConfigCommand(), a.debeziumEnableCommand(), a.debeziumDisableCommand(), a.debeziumStatusCommand())
	return cmd
}

func (a *app) debeziumConfigCommand() *cobra.Command {
	var (
		opts   debezium.Options
		format string
		output string
	)
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Write the Debezium outbox event router connector configuration (no database needed)",
		Long: `Write the Kafka Connect configuration of the Debezium PostgreSQL connector
with the outbox event router, generated from the schema by the debezium
package (the shipped debezium/outbox-connector.* files are this output with
the default options). --format json is the Kafka Connect REST form,
--format properties the standalone worker form.`,
		Args: cobra.NoArgs,
		RunE: a.runE(func(_ context.Context, _ *cobra.Command, _ []string) error {
			c := debezium.Generate(opts)
			var buf bytes.Buffer
			var err error
			switch format {
			case "json":
				err = c.WriteJSON(&buf)
			case "properties":
				err = c.WriteProperties(&buf)
			default:
				return outbox.Errorf(CodeUsage, "outboxctl debezium config", "--format is %q; use json or properties", format)
			}
			if err != nil {
				return err
			}
			if output == "" || output == "-" {
				_, err = a.stdout.Write(buf.Bytes())
				return err
			}
			if err := writeFileAtomic(output, buf.Bytes()); err != nil { // 0600, temp + rename, no symlink follow
				return err
			}
			a.progress("wrote %s (%d bytes)", output, buf.Len())
			return nil
		}),
	}
	f := cmd.Flags()
	f.StringVar(&format, "format", "json", "json or properties")
	f.StringVarP(&output, "output", "o", "", "write to this file instead of stdout")
	f.StringVar(&opts.TopicPrefix, "topic-prefix", "", "prefix of the Kafka topic names (topic = prefix + destination)")
	f.StringVar(&opts.Name, "name", "", "connector name (default messaging-outbox)")
	f.StringVar(&opts.Schema, "schema", "", "schema holding messaging_outbox (default public)")
	f.StringVar(&opts.ServerName, "server-name", "", "Debezium topic.prefix for its own topics (default outbox-cdc)")
	f.StringVar(&opts.SlotName, "slot", "", "replication slot name (default messaging_outbox_cdc, the native relay's default too)")
	f.IntVar(&opts.HeartbeatIntervalMS, "heartbeat-interval-ms", 0, "heartbeat.interval.ms (default 10000); each heartbeat runs the heartbeat action query")
	f.StringVar(&opts.PublicationName, "publication", "", "publication name (default messaging_outbox_cdc)")
	return cmd
}

// checkOperator refuses a --by that PostgreSQL text cannot store (NUL,
// invalid UTF-8) or that holds control characters (it is printed by
// status and in the audit of the mode switch) with OUTBOXCTL_USAGE, exit 2,
// before the database is opened.
func checkOperator(cmdName, by string) error {
	if why := pgtext.Unstorable(by); why != "" {
		return runError{outbox.Errorf(CodeUsage, cmdName, "--by %s", why)}
	}
	if i := pgtext.ControlAt(by); i >= 0 {
		return runError{outbox.Errorf(CodeUsage, cmdName, "--by contains a control character at byte %d; give a plain operator name", i)}
	}
	return nil
}

// withOperator runs body after checkOperator accepted *by.
func withOperator(cmdName string, by *string, body func(*cobra.Command, []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		if err := checkOperator(cmdName, *by); err != nil {
			return err
		}
		return body(cmd, args)
	}
}

// defaultOperator names who switches the relay mode when --by is not given.
func defaultOperator() string {
	name := "outboxctl"
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	if h, err := os.Hostname(); err == nil && h != "" {
		name += "@" + h
	}
	return name
}

func (a *app) debeziumEnableCommand() *cobra.Command {
	var by string
	cmd := &cobra.Command{
		Use:   "enable",
		Short: "Switch the database to CDC relay mode (refused while polling relays are live)",
		Long: `Record CDC as the database's relay mode. Refused with RELAY_MODE_CONFLICT
(exit 3) while any polling relay's heartbeat is live: stop the forwarders
first, or wait for their heartbeats to expire. Once enabled, forwarders
refuse to start.`,
		Args: cobra.NoArgs,
		RunE: withOperator("outboxctl debezium enable", &by, a.withDB(func(ctx context.Context, db *sql.DB, _ *cobra.Command, _ []string) error {
			if err := relaymode.Enable(ctx, db, by, time.Time{}); err != nil {
				return err
			}
			return a.printMode(ctx, db)
		})),
	}
	cmd.Flags().StringVar(&by, "by", defaultOperator(), "who switches the mode (recorded in messaging_relay_mode)")
	return cmd
}

func (a *app) debeziumDisableCommand() *cobra.Command {
	var by string
	cmd := &cobra.Command{
		Use:   "disable",
		Short: "Switch the database back to POLLING relay mode (refused while a CDC consumer's heartbeat is live: stop it first)",
		Args:  cobra.NoArgs,
		RunE: withOperator("outboxctl debezium disable", &by, a.withDB(func(ctx context.Context, db *sql.DB, _ *cobra.Command, _ []string) error {
			if err := relaymode.Disable(ctx, db, by); err != nil {
				return err
			}
			return a.printMode(ctx, db)
		})),
	}
	cmd.Flags().StringVar(&by, "by", defaultOperator(), "who switches the mode (recorded in messaging_relay_mode)")
	return cmd
}

func (a *app) debeziumStatusCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Print the relay mode and the live polling relays",
		Args:  cobra.NoArgs,
		RunE: a.withDB(func(ctx context.Context, db *sql.DB, _ *cobra.Command, _ []string) error {
			return a.printMode(ctx, db)
		}),
	}
}

func (a *app) printMode(ctx context.Context, db *sql.DB) error {
	mode, err := relaymode.CurrentMode(ctx, db)
	if err != nil {
		return err
	}
	live, err := relaymode.LiveRelays(ctx, db, time.Time{})
	if err != nil {
		return err
	}
	cdc, err := relaymode.LiveCDCConsumers(ctx, db, time.Time{})
	if err != nil {
		return err
	}
	if a.json {
		relays := make([]map[string]any, len(live))
		for i, h := range live {
			relays[i] = map[string]any{"owner": h.Owner, "heartbeat_at": h.HeartbeatAt.UTC(), "expires_at": h.ExpiresAt.UTC()}
		}
		consumers := make([]map[string]any, len(cdc))
		for i, h := range cdc {
			consumers[i] = map[string]any{"owner": h.Owner, "slot_name": h.SlotName, "heartbeat_at": h.HeartbeatAt.UTC(), "expires_at": h.ExpiresAt.UTC()}
		}
		return a.printJSON(map[string]any{"relay_mode": string(mode), "live_relays": relays, "cdc_consumers": consumers})
	}
	fmt.Fprintf(a.stdout, "relay mode: %s\n", mode)
	section(a.stdout, "LIVE POLLING RELAYS")
	t := newTable(a.stdout)
	t.row("OWNER", "HEARTBEAT", "EXPIRES")
	for _, h := range live {
		t.row(h.Owner, h.HeartbeatAt, h.ExpiresAt)
	}
	if err := t.flush(); err != nil {
		return err
	}
	section(a.stdout, "LIVE CDC CONSUMERS")
	t = newTable(a.stdout)
	t.row("OWNER", "SLOT", "HEARTBEAT", "EXPIRES")
	for _, h := range cdc {
		t.row(h.Owner, h.SlotName, h.HeartbeatAt, h.ExpiresAt)
	}
	return t.flush()
}
