package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/cmd/outboxctl/internal/console"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// DefaultConsoleListen is where the console listens unless told otherwise:
// loopback only.
const DefaultConsoleListen = "127.0.0.1:8089"

func init() { usageCodes[console.CodeInvalidConfig] = true }

type consoleFlags struct {
	listen      string
	tlsCert     string
	tlsKey      string
	readOnly    bool
	idleTimeout time.Duration
	maxSession  time.Duration
	logs        logFlags
}

func (a *app) consoleCommand() *cobra.Command {
	var f consoleFlags
	cmd := &cobra.Command{
		Use:   "console",
		Short: "Serve the operator web console: backlog, parked rows, relays, the journal; plan, approve and execute redrives and purges",
		Long: `Serve the operator web console (docs/CONSOLE.md). Each person signs in with
their own PostgreSQL login and password: the console opens a small pool with
them, held in memory for the session and closed at sign-out or expiry, and
their grants decide what they see and do (docs/SECURITY.md). The database URL
names the server and the schema (search_path); its user and password, if any,
are replaced by the person's.

It listens on 127.0.0.1 unless --listen says otherwise; another address needs
--tls-cert and --tls-key (passwords cross the network). With --read-only the
database URL's own login (holding only the status and inspect grants) answers
every page, nobody signs in and nothing can be changed.

Runs until SIGINT or SIGTERM.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := bindEnv(cmd, a.getenv); err != nil {
				return runError{err}
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			if err := a.runConsole(ctx, &f); err != nil {
				return runError{err}
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.listen, "listen", DefaultConsoleListen, "address to listen on (a non-loopback address needs --tls-cert and --tls-key)")
	fl.StringVar(&f.tlsCert, "tls-cert", "", "PEM certificate file: serve HTTPS (cookies are then Secure)")
	fl.StringVar(&f.tlsKey, "tls-key", "", "PEM private key file of --tls-cert")
	fl.BoolVar(&f.readOnly, "read-only", false, "serve every page through the database URL's own login (status and inspect grants only); no sign-in, no actions")
	fl.DurationVar(&f.idleTimeout, "idle-timeout", console.DefaultIdleTimeout, "end a session unused this long (its pool is closed)")
	fl.DurationVar(&f.maxSession, "max-session", console.DefaultMaxSession, "end any session this long after sign-in")
	fl.StringVar(&f.logs.format, "log-format", "text", "log format on stderr: text or json")
	fl.StringVar(&f.logs.level, "log-level", "info", "debug, info, warn or error")
	envFlags(cmd)
	return cmd
}

func (a *app) runConsole(ctx context.Context, f *consoleFlags) error {
	const op = "outboxctl console"
	logger, err := a.newLogger(a.stderr, f.logs)
	if err != nil {
		return err
	}
	if (f.tlsCert == "") != (f.tlsKey == "") {
		return outbox.Errorf(CodeUsage, op, "give both --tls-cert and --tls-key, or neither")
	}
	host, _, err := net.SplitHostPort(f.listen)
	if err != nil {
		return outbox.Errorf(CodeUsage, op, "--listen %q is not host:port", f.listen)
	}
	if ip := net.ParseIP(host); f.tlsCert == "" && host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return outbox.Errorf(CodeUsage, op, "--listen %s is not a loopback address: give --tls-cert and --tls-key, so that passwords and session cookies do not cross the network in clear", f.listen)
	}
	if f.idleTimeout <= 0 || f.maxSession <= 0 {
		return outbox.Errorf(CodeUsage, op, "--idle-timeout and --max-session must be positive")
	}
	cfg := console.Config{
		DatabaseURL: a.resolvedURL(), Secure: f.tlsCert != "", IdleTimeout: f.idleTimeout, MaxSession: f.maxSession, Logger: logger,
	}
	if cfg.DatabaseURL == "" {
		return outbox.Errorf(CodeDatabaseURLRequired, op, "set --database-url, OUTBOX_DATABASE_URL or OUTBOX_DATABASE_URL_FILE")
	}
	if f.readOnly {
		db, err := a.openDB(ctx)
		if err != nil {
			return err
		}
		defer db.Close()
		if err := migrations.Check(ctx, db); err != nil {
			return err
		}
		cfg.ReadOnlyDB = db
	}
	srv, err := console.New(cfg)
	if err != nil {
		return err
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return outbox.Wrap(CodeUsage, op, err, "cannot listen on "+f.listen)
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute}
	scheme := "http"
	if f.tlsCert != "" {
		cert, err := tls.LoadX509KeyPair(f.tlsCert, f.tlsKey)
		if err != nil {
			_ = ln.Close()
			return outbox.Wrap(CodeUsage, op, err, "cannot load --tls-cert/--tls-key")
		}
		hs.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
		ln = tls.NewListener(ln, hs.TLSConfig)
		scheme = "https"
	}
	mode := "sign-in with PostgreSQL logins"
	if f.readOnly {
		mode = "read-only"
	}
	logger.Info("console: listening", "url", fmt.Sprintf("%s://%s/", scheme, ln.Addr()), "mode", mode)
	fmt.Fprintf(a.stdout, "outbox console (%s) on %s://%s/\n", mode, scheme, ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = hs.Shutdown(shutdown)
	return nil
}
