package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/lib/pq"
	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/redact"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

// Exit codes. They are part of the CLI's contract (see doc.go and --help).
const (
	ExitOK          = 0 // the command did what it was asked
	ExitFailed      = 1 // the operation failed (a database error, a row not found, a write that did not happen)
	ExitUsage       = 2 // bad flags or arguments, invalid configuration, missing --database-url
	ExitRefused     = 3 // a guard refused: journal already executed / in flight, plan mismatch, relay mode conflict
	ExitUnreachable = 4 // the database could not be reached
	ExitSkipped     = 5 // cleanup did nothing: another session holds the retention lock
)

// Codes of the refusals the CLI itself makes.
const (
	CodeDatabaseURLRequired outbox.Code = "OUTBOXCTL_DATABASE_URL_REQUIRED"
	CodeInvalidDatabaseURL  outbox.Code = "OUTBOXCTL_INVALID_DATABASE_URL"
	CodeDatabaseUnreachable outbox.Code = "OUTBOXCTL_DATABASE_UNREACHABLE"
	// CodeDatabaseRefused: the server answered and refused the connection's
	// settings (no such database or role, a wrong password, a bad parameter
	// value): retrying does not help, the URL must change (exit 2).
	CodeDatabaseRefused outbox.Code = "OUTBOXCTL_DATABASE_REFUSED"
	CodeUsage           outbox.Code = "OUTBOXCTL_USAGE"
	CodeRetentionMode   outbox.Code = "OUTBOXCTL_RETENTION_MODE_MISMATCH"
	// CodeCleanupSkipped: cleanup removed nothing because another session
	// holds the retention lock (exit 5); the error names the holder.
	CodeCleanupSkipped outbox.Code = "OUTBOXCTL_CLEANUP_SKIPPED"
)

// guardCodes are refusals by a guard (exit 3): the request was well formed
// and the database was reachable, but running it would break a guarantee.
var guardCodes = map[outbox.Code]bool{
	relaymode.CodeRelayModeConflict: true,
	CodeRetentionMode:               true,
	fencing.CodeLanesBusy:           true,
	fencing.CodeFenceConflict:       true,
}

// usageCodes are typed errors that mean "change the command line" (exit 2).
var usageCodes = map[outbox.Code]bool{
	outbox.CodeInvalidConfig:        true,
	outbox.CodeLeaseTooShort:        true,
	outbox.CodeMessageIDRequired:    true,
	relaymode.CodeOperatorRequired:  true,
	CodeDatabaseURLRequired:         true,
	CodeInvalidDatabaseURL:          true,
	CodeDatabaseRefused:             true,
	CodeUsage:                       true,
	retention.CodeHorizonBelowFloor: true,
	// The search_path reaches no migrated schema: the configuration (the
	// URL's search_path) or the deployment (migrate not run) must change.
	migrations.CodeSchemaNotMigrated: true,
}

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, os.Getenv))
}

// app holds the global flags and the process's streams, shared by every
// subcommand.
type app struct {
	stdout, stderr io.Writer
	getenv         func(string) string

	databaseURL string
	json        bool
	timeout     time.Duration

	// secretSources are connection strings whose secrets must never be
	// printed: the database URL and, for the relay, the broker URLs. Every
	// error and log line goes through redactError / the log handler, which
	// mask what these contain (see internal/redact).
	secretSources []string
}

// runError marks an error returned by a command's own code, as opposed to
// one cobra returns while parsing the command line (a usage error).
type runError struct{ err error }

func (e runError) Error() string { return e.err.Error() }
func (e runError) Unwrap() error { return e.err }

// exitCode maps an error to the documented exit codes.
func exitCode(err error) int {
	if err == nil {
		return ExitOK
	}
	var re runError
	if !errors.As(err, &re) {
		return ExitUsage // cobra: unknown flag, bad argument count, bad flag value
	}
	code := outbox.CodeOf(err)
	switch {
	case code == CodeDatabaseUnreachable:
		return ExitUnreachable
	case code == CodeCleanupSkipped:
		return ExitSkipped
	case guardCodes[code]:
		return ExitRefused
	case usageCodes[code]:
		return ExitUsage
	}
	return ExitFailed
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	a := &app{stdout: stdout, stderr: stderr, getenv: getenv}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	code := exitCode(err)
	var re runError
	if err != nil && !errors.As(err, &re) {
		// cobra's own refusal (unknown command or flag, bad argument count
		// or value): a usage error with its code, like the CLI's own.
		err = outbox.Wrap(CodeUsage, "outboxctl", err, "")
		// cobra may refuse before it parsed --json (an unknown command, or
		// a bad flag ahead of it): the caller asked for JSON all the same.
		a.json = a.json || jsonRequested(args)
	}
	if err != nil {
		a.printError(err, code)
	}
	return code
}

// jsonRequested reports whether args ask for --json before a "--".
func jsonRequested(args []string) bool {
	for _, arg := range args {
		switch arg {
		case "--":
			return false
		case "--json", "--json=true", "--json=1", "--json=t", "--json=TRUE", "--json=True", "--json=T":
			return true
		}
	}
	return false
}

// redactError masks, in err's text, every secret of the database URL and of
// the other connection strings the command was given, and anything
// URL-shaped or key=value-shaped that looks like a password. It is the one
// redaction every error the CLI prints goes through.
func (a *app) redactError(err error) error {
	if err == nil {
		return nil
	}
	err = redact.Error(err, a.resolvedURL())
	for _, src := range a.secretSources {
		err = redact.Error(err, src)
	}
	return err
}

// redactString is redactError for a text.
func (a *app) redactString(s string) string {
	return a.redactError(errors.New(s)).Error()
}

func (a *app) printError(err error, exit int) {
	code := outbox.CodeOf(err)
	err = a.redactError(err)
	if a.json {
		doc := map[string]any{"error": err.Error(), "code": code, "exit_code": exit}
		var re *resumeError
		if errors.As(err, &re) {
			doc["resume"] = a.redactString(re.resume)
		}
		_ = json.NewEncoder(a.stderr).Encode(doc)
		return
	}
	fmt.Fprintf(a.stderr, "error: %v\n", err)
	if code != "" {
		fmt.Fprintf(a.stderr, "code: %s\n", code)
	}
	if exit == ExitUsage && (code == "" || code == CodeUsage) {
		// A command line that did not parse; typed refusals say themselves
		// what to change.
		fmt.Fprintln(a.stderr, "Run 'outboxctl --help' for usage.")
	}
}

const rootLong = `outboxctl operates a watermill-outbox database: migrate the schema, look at
the backlog, inspect a message, redrive or purge parked rows exactly once,
run retention, run a standalone relay, and manage the Debezium CDC mode.

The database comes from --database-url, OUTBOX_DATABASE_URL or the file
OUTBOX_DATABASE_URL_FILE names (a lib/pq URL or key=value string; set
search_path in it to select a schema). Prefer the variable or the file: flags
show in ps. No output ever prints its password.

Output is an aligned table by default; --json prints one JSON document on
stdout (and errors as JSON on stderr).

Exit codes:
  0  ok
  1  the operation failed (database error, message not found, an interrupted
     redrive/purge: the error ends with the command that resumes it)
  2  usage error: bad flags or arguments, invalid configuration, missing or
     malformed database URL, one the server refuses (no such database or role,
     wrong password), schema not migrated (run outboxctl migrate)
  3  refused by a guard: journal already executed or in flight, plan mismatch,
     relay mode conflict, retention mode that does not match the relay mode
  4  the database is unreachable
  5  cleanup skipped: another session holds the retention lock (named)
Typed refusals print their stable code ("code: JOURNAL_ALREADY_EXECUTED").`

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "outboxctl",
		Short:         "Operate a watermill-outbox database",
		Long:          rootLong,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&a.databaseURL, "database-url", "", "PostgreSQL URL (default $OUTBOX_DATABASE_URL)")
	root.PersistentFlags().BoolVar(&a.json, "json", false, "print JSON instead of tables")
	root.PersistentFlags().DurationVar(&a.timeout, "timeout", 5*time.Minute, "bound for the whole command (0 = none; negative is refused); not applied to relay (runs until SIGINT/SIGTERM) nor to redrive/purge executions (run to completion; a cut prints how to resume)")
	root.CompletionOptions.DisableDefaultCmd = true
	// Every command (relay included, which ignores --timeout) refuses a
	// negative --timeout rather than read it as "none": 0 is the only way
	// to say none.
	root.PersistentPreRunE = func(_ *cobra.Command, _ []string) error {
		if a.timeout < 0 {
			return outbox.Errorf(CodeUsage, "outboxctl", "--timeout is %s; use a positive duration, or 0 for none", a.timeout)
		}
		return nil
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return err })
	root.AddCommand(
		a.migrateCommand(),
		a.statusCommand(),
		a.inspectCommand(),
		a.redriveCommand(),
		a.purgeCommand(),
		a.cleanupCommand(),
		a.relayCommand(),
		a.lanesCommand(),
		a.debeziumCommand(),
		a.consoleCommand(),
		a.versionCommand(),
	)
	return root
}

// runE wraps a command body: it applies --timeout and marks the body's errors
// as run errors (not usage errors) for exitCode.
func (a *app) runE(fn func(ctx context.Context, cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		if a.timeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, a.timeout)
			defer cancel()
		}
		if err := fn(ctx, cmd, args); err != nil {
			return runError{err}
		}
		return nil
	}
}

// resolvedURL is the database URL the command connects with: --database-url,
// else OUTBOX_DATABASE_URL, else the content of the file
// OUTBOX_DATABASE_URL_FILE names (a mounted secret), blanks trimmed (""
// when none is set or the file cannot be read: openDB reports why). openDB
// and the relay's LISTEN connection both use it, so they reach the same
// database.
func (a *app) resolvedURL() string {
	if url := strings.TrimSpace(a.databaseURL); url != "" {
		return url
	}
	v, _, _ := lookupFile(a.getenv, "OUTBOX_DATABASE_URL")
	return strings.TrimSpace(v)
}

// openDB opens and pings the database. A missing URL is a usage error, and
// so is one that does not parse (OUTBOXCTL_INVALID_DATABASE_URL, whose
// message never quotes the URL: a parse error would print the password); a
// ping that fails is "unreachable" (exit 4) so scripts can retry on it alone.
func (a *app) openDB(ctx context.Context) (*sql.DB, error) {
	dsn := a.resolvedURL()
	if dsn == "" {
		if _, _, err := lookupFile(a.getenv, "OUTBOX_DATABASE_URL"); err != nil {
			return nil, err
		}
		return nil, outbox.Errorf(CodeDatabaseURLRequired, "outboxctl", "set --database-url, OUTBOX_DATABASE_URL or OUTBOX_DATABASE_URL_FILE")
	}
	connector, err := pq.NewConnector(dsn)
	if err != nil {
		return nil, invalidDatabaseURL(dsn, err)
	}
	db := sql.OpenDB(connector)
	// An operator tool needs few connections; keep the shared server's
	// connection budget for the applications.
	db.SetMaxOpenConns(4)
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		_ = db.Close()
		var pe *pq.Error
		if errors.As(err, &pe) && (pe.Code.Class() == "28" || pe.Code == "3D000" || pe.Code == "22023" || pe.Code == "42704") {
			return nil, outbox.Wrap(CodeDatabaseRefused, "outboxctl", a.redactError(err),
				"the server refused the connection settings (database, role, password or a parameter value): fix the database URL; retrying will not help")
		}
		return nil, outbox.Wrap(CodeDatabaseUnreachable, "outboxctl", a.redactError(err), "cannot reach the database")
	}
	return db, nil
}

// invalidDatabaseURL describes why dsn does not make a connection
// configuration without quoting any of it or of the parser's error: both
// may carry the password (net/url quotes the whole input; lib/pq quotes the
// keys and values it stumbles on).
func invalidDatabaseURL(dsn string, err error) error {
	var uerr *url.Error
	isURL := strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://")
	var what string
	switch {
	case errors.As(err, &uerr) || (isURL && strings.Contains(err.Error(), "parse")):
		what = "it does not parse as a postgres:// URL: percent-encode reserved characters of the user and password (% as %25, @ as %40, : as %3A, / as %2F, # as %23), close an IPv6 host's brackets, and check that the port is a number"
	case isURL:
		what = "lib/pq refuses the URL or one of its parameters (or a PG* environment variable or service file it reads)"
	case strings.Contains(dsn, "://"):
		what = "the scheme must be postgres:// or postgresql://"
	default:
		what = "lib/pq refuses the key=value string or one of its values (or a PG* environment variable or service file it reads): quote values with spaces in single quotes, give every key a '='"
	}
	return outbox.Errorf(CodeInvalidDatabaseURL, "outboxctl",
		"the database URL (--database-url or OUTBOX_DATABASE_URL) is not usable: %s; neither it nor the parser's message is shown, as either may hold the password", what)
}

// withDB runs fn with an open database whose search_path reaches a migrated
// schema (OUTBOX_SCHEMA_NOT_MIGRATED otherwise), closing it afterwards.
func (a *app) withDB(fn func(ctx context.Context, db *sql.DB, cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return a.runE(a.withDBCtx(true, fn))
}

// withDBCtx is withDB's body without --timeout: journal executions apply
// their own. checkSchema is false only for migrate.
func (a *app) withDBCtx(checkSchema bool, fn func(ctx context.Context, db *sql.DB, cmd *cobra.Command, args []string) error) func(ctx context.Context, cmd *cobra.Command, args []string) error {
	return func(ctx context.Context, cmd *cobra.Command, args []string) error {
		db, err := a.openDB(ctx)
		if err != nil {
			return err
		}
		defer db.Close()
		if checkSchema {
			if err := migrations.Check(ctx, db); err != nil {
				return err
			}
		}
		return fn(ctx, db, cmd, args)
	}
}

// printJSON writes v as indented JSON on stdout.
func (a *app) printJSON(v any) error {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// progress writes a progress line on stderr (stdout stays machine-readable).
func (a *app) progress(format string, args ...any) {
	fmt.Fprintf(a.stderr, format+"\n", args...)
}
