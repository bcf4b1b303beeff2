package console

import (
	"cmp"
	"context"
	"database/sql"
	"embed"
	"errors"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	neturl "net/url"
	"strings"
	"sync"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/redact"
)

//go:embed assets
var assets embed.FS

// Defaults of Config's zero values.
const (
	DefaultIdleTimeout    = 15 * time.Minute
	DefaultMaxSession     = 8 * time.Hour
	DefaultSignInFailures = 5
	DefaultSignInWindow   = time.Minute
	DefaultPageSize       = 50
	// DefaultPoolSize is each signed-in person's pool: a page runs its
	// queries one after another, an execution holds one more.
	DefaultPoolSize = 3
	// DefaultOverviewMaxAge: see Config.OverviewMaxAge.
	DefaultOverviewMaxAge = 10 * time.Second
)

// Config configures a console. Zero values take the defaults above.
type Config struct {
	// DatabaseURL is the server the console signs people in to, a
	// postgres:// URL (search_path selecting the schema); its user and
	// password, if any, are replaced by the person's login and password at
	// sign-in. Required unless ReadOnlyDB is set.
	DatabaseURL string
	// ReadOnlyDB, when set, puts the console in read-only mode: every page
	// is answered through this pool (a login holding only the status and
	// inspect grants, docs/SECURITY.md), nobody signs in, and every
	// state-changing request is refused (CONSOLE_READ_ONLY).
	ReadOnlyDB *sql.DB
	// Secure marks cookies Secure: set it when the console serves TLS.
	Secure bool
	// IdleTimeout ends a session unused this long; MaxSession ends any
	// session this long after sign-in. The session's pool is closed then.
	IdleTimeout time.Duration
	MaxSession  time.Duration
	// SignInFailures failed sign-ins within SignInWindow, from one address
	// or for one login, refuse every further attempt from it or for it
	// until the window passes (CONSOLE_SIGN_IN_RATE_LIMITED).
	SignInFailures int
	SignInWindow   time.Duration
	// PageSize is the parked rows listed per page.
	PageSize int
	// PoolSize is the most connections each session's pool opens.
	PoolSize int
	// OverviewMaxAge is how old the overview's figures may be before a
	// request for the page refreshes them in the background (the page is
	// answered from the figures it has, with their age; the first request
	// of a session waits for them, and ?fresh=1 always does).
	OverviewMaxAge time.Duration
	// Logger receives sign-ins, sign-outs, refusals and actions (never a
	// password or a connection string's secret). Nil discards.
	Logger *slog.Logger
	// Now is the clock of sessions and the rate limit (tests pin it).
	Now func() time.Time
}

func (c Config) withDefaults() Config {
	c.IdleTimeout = cmp.Or(c.IdleTimeout, DefaultIdleTimeout)
	c.MaxSession = cmp.Or(c.MaxSession, DefaultMaxSession)
	c.SignInFailures = cmp.Or(c.SignInFailures, DefaultSignInFailures)
	c.SignInWindow = cmp.Or(c.SignInWindow, DefaultSignInWindow)
	c.PageSize = cmp.Or(c.PageSize, DefaultPageSize)
	c.PoolSize = cmp.Or(c.PoolSize, DefaultPoolSize)
	c.OverviewMaxAge = cmp.Or(c.OverviewMaxAge, DefaultOverviewMaxAge)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Validate refuses configurations the console cannot serve safely
// (CONSOLE_INVALID_CONFIG), saying what to change. It never quotes the URL.
func (c Config) Validate() error {
	const op = "console.Config"
	if c.ReadOnlyDB == nil {
		if c.DatabaseURL == "" {
			return outbox.Errorf(CodeInvalidConfig, op, "set the database URL people sign in to (or a read-only pool)")
		}
		u, err := neturl.Parse(c.DatabaseURL)
		if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") || u.Host == "" {
			return outbox.Errorf(CodeInvalidConfig, op, "the database URL must be a postgres:// URL with a host (the console puts each person's login into it); the URL is not shown, it may hold a password")
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"IdleTimeout", c.IdleTimeout}, {"MaxSession", c.MaxSession}, {"SignInWindow", c.SignInWindow}, {"OverviewMaxAge", c.OverviewMaxAge}} {
		if d.v < 0 {
			return outbox.Errorf(CodeInvalidConfig, op, "%s is %s; use a positive duration (0 = default)", d.name, d.v)
		}
	}
	if c.SignInFailures < 0 || c.PageSize < 0 || c.PageSize > 1000 || c.PoolSize < 0 || c.PoolSize > 20 {
		return outbox.Errorf(CodeInvalidConfig, op, "SignInFailures, PageSize (at most 1000) and PoolSize (at most 20) must be 0 (default) or positive")
	}
	return nil
}

// Server is the console: an http.Handler with its sessions. Close it to
// close every session's pool.
type Server struct {
	cfg   Config
	pages map[string]*template.Template
	mux   *http.ServeMux

	mu       sync.Mutex
	sessions map[string]*session
	limiter  *limiter
	plans    map[string]*proposal // ticket -> plan waiting for approval
	runs     map[string]*execution
	closed   bool

	readOnlyOverview *overviewCache // the read-only console's (one login for all)

	stop chan struct{}
	done chan struct{}
	wg   sync.WaitGroup // executions in flight
}

// New returns a console for cfg. It opens nothing: pools are opened at
// sign-in (or given, in read-only mode).
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	s := &Server{
		cfg:      cfg,
		sessions: map[string]*session{},
		limiter:  newLimiter(cfg.SignInFailures, cfg.SignInWindow),
		plans:    map[string]*proposal{},
		runs:     map[string]*execution{},

		readOnlyOverview: &overviewCache{},
		stop:             make(chan struct{}),
		done:             make(chan struct{}),
	}
	var err error
	if s.pages, err = parsePages(); err != nil {
		return nil, err
	}
	s.routes()
	go s.sweep()
	return s, nil
}

// ReadOnly reports whether the console was started in read-only mode.
func (s *Server) ReadOnly() bool { return s.cfg.ReadOnlyDB != nil }

// ServeHTTP serves the console with its security headers on every response.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", ContentSecurityPolicy)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	if s.cfg.Secure {
		h.Set("Strict-Transport-Security", "max-age=31536000")
	}
	// Every form of the console is a few short fields.
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	s.mux.ServeHTTP(w, r)
}

// maxFormBytes bounds a request body.
const maxFormBytes = 64 << 10

// ContentSecurityPolicy is sent with every response: nothing but the
// console's own embedded files, no inline script or style, no framing.
const ContentSecurityPolicy = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; " +
	"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// Close ends every session (closing its pool) after the executions still
// running return. Safe to call twice.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.done
		return nil
	}
	s.closed = true
	close(s.stop)
	s.mu.Unlock()
	<-s.done
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, se := range s.sessions {
		delete(s.sessions, id)
		_ = se.db.Close()
	}
	return nil
}

// sweep ends expired sessions every minute, so an abandoned session's pool
// does not outlive its expiry by more than that.
func (s *Server) sweep() {
	defer close(s.done)
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			s.expire()
		}
	}
}

func (s *Server) routes() {
	m := http.NewServeMux()
	static, _ := fs.Sub(assets, "assets/static")
	m.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	m.HandleFunc("GET /signin", s.signInPage)
	m.HandleFunc("POST /signin", s.signIn)
	m.HandleFunc("POST /signout", s.action(s.signOut))
	m.HandleFunc("GET /{$}", s.page(s.overview))
	m.HandleFunc("GET /parked", s.page(s.parked))
	m.HandleFunc("GET /row", s.page(s.row))
	m.HandleFunc("GET /relays", s.page(s.relays))
	m.HandleFunc("GET /ops", s.page(s.ops))
	m.HandleFunc("GET /ops/ticket", s.page(s.ticket))
	m.HandleFunc("POST /plan", s.action(s.plan))
	m.HandleFunc("POST /approve", s.action(s.approve))
	m.HandleFunc("POST /execute", s.action(s.execute))
	s.mux = m
}

// redactErr masks every secret of the configured URL (and anything
// password-shaped) in err's text.
func (s *Server) redactErr(err error) error {
	return redact.Error(err, s.cfg.DatabaseURL)
}

// errText is what a page shows of err: its code and redacted text.
func (s *Server) errText(err error) string {
	if err == nil {
		return ""
	}
	text := s.redactErr(err).Error()
	if c := outbox.CodeOf(err); c != "" && !strings.Contains(text, string(c)) {
		text = string(c) + ": " + text
	}
	return text
}

// pageErr is an error with the HTTP status its page answers with.
type pageErr struct {
	status int
	err    error
}

func (e *pageErr) Error() string { return e.err.Error() }
func (e *pageErr) Unwrap() error { return e.err }

func refuse(status int, code outbox.Code, format string, args ...any) error {
	return &pageErr{status: status, err: outbox.Errorf(code, "console", format, args...)}
}

func statusOf(err error) int {
	var pe *pageErr
	if errors.As(err, &pe) {
		return pe.status
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}
