package console

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"database/sql"
	"encoding/base64"
	"errors"
	"net"
	"net/http"
	neturl "net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// Cookie names. The session cookie holds a random id only; everything else
// (the pool, the login, the CSRF token) stays in the console's memory.
const (
	sessionCookie = "outbox_console_session"
	preCookie     = "outbox_console_signin" // double-submit token of the sign-in form
)

// session is one signed-in person: their login (session_user, as the
// database names it) and their own pool, opened with their password, which
// is not kept anywhere once the pool's connector holds it.
type session struct {
	id      string
	csrf    string
	login   string
	db      *sql.DB
	created time.Time
	seen    time.Time
	ov      *overviewCache // this person's overview figures
}

// viewer is who a page is answered for: a signed-in session, or the
// read-only console's own pool.
type viewer struct {
	login    string
	db       *sql.DB
	csrf     string
	readOnly bool
	ov       *overviewCache
}

func randomToken() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}

// limiter counts failed sign-ins per key (an address, a login) within a
// fixed window from the first failure.
type limiter struct {
	mu     sync.Mutex
	max    int
	window time.Duration
	fails  map[string]*failures
}

type failures struct {
	first time.Time
	n     int
}

func newLimiter(max int, window time.Duration) *limiter {
	return &limiter{max: max, window: window, fails: map[string]*failures{}}
}

// blocked returns how long key is still refused (0: not refused).
func (l *limiter) blocked(key string, now time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.fails[key]
	if f == nil {
		return 0
	}
	if now.Sub(f.first) >= l.window {
		delete(l.fails, key)
		return 0
	}
	if f.n < l.max {
		return 0
	}
	return f.first.Add(l.window).Sub(now)
}

func (l *limiter) fail(key string, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.fails[key]
	if f == nil || now.Sub(f.first) >= l.window {
		f = &failures{first: now}
		l.fails[key] = f
	}
	f.n++
	// Bound the map: keys whose window passed are dropped as it grows.
	if len(l.fails) > 10000 {
		for k, v := range l.fails {
			if now.Sub(v.first) >= l.window {
				delete(l.fails, k)
			}
		}
	}
}

func clientAddr(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

func (s *Server) cookie(name, value string, maxAge time.Duration) *http.Cookie {
	c := &http.Cookie{Name: name, Value: value, Path: "/", HttpOnly: true, Secure: s.cfg.Secure, SameSite: http.SameSiteStrictMode}
	if maxAge < 0 {
		c.MaxAge = -1
	} else if maxAge > 0 {
		c.MaxAge = int(maxAge / time.Second)
	}
	return c
}

func (s *Server) signInPage(w http.ResponseWriter, r *http.Request) {
	if s.ReadOnly() {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	s.renderSignIn(w, r, http.StatusOK, "")
}

func (s *Server) renderSignIn(w http.ResponseWriter, r *http.Request, status int, msg string) {
	token := randomToken()
	http.SetCookie(w, s.cookie(preCookie, token, 10*time.Minute))
	s.render(w, status, "signin", &pageData{Title: "Sign in", CSRF: token, Error: msg})
}

// signIn opens a pool with the login and password given, checks that it
// connects and reaches a migrated schema, and starts a session holding it.
// Failures are counted per address and per login; the answer never says
// whether the login exists.
func (s *Server) signIn(w http.ResponseWriter, r *http.Request) {
	if s.ReadOnly() {
		s.fail(w, r, nil, refuse(http.StatusForbidden, CodeReadOnly, "this console is read-only: nobody signs in"))
		return
	}
	now := s.cfg.Now()
	login := strings.TrimSpace(r.PostFormValue("login"))
	password := r.PostFormValue("password")
	pre, err := r.Cookie(preCookie)
	if err != nil || !sameToken(pre.Value, r.PostFormValue("csrf")) {
		s.cfg.Logger.Warn("console: sign-in refused: CSRF token missing or wrong", "code", CodeCSRF, "addr", clientAddr(r))
		s.fail(w, r, nil, refuse(http.StatusForbidden, CodeCSRF, "the sign-in form's token is missing or wrong: reload the sign-in page"))
		return
	}
	addr := clientAddr(r)
	wait := max(s.limiter.blocked("addr:"+addr, now), s.limiter.blocked("login:"+login, now))
	if wait > 0 {
		s.cfg.Logger.Warn("console: sign-in rate-limited", "code", CodeSignInRateLimited, "login", login, "addr", addr)
		w.Header().Set("Retry-After", strconv.Itoa(int(wait.Round(time.Second)/time.Second)+1))
		s.renderSignIn(w, r, http.StatusTooManyRequests, string(CodeSignInRateLimited)+": too many failed sign-ins; try again in "+wait.Round(time.Second).String())
		return
	}
	se, err := s.open(r.Context(), login, password)
	if err != nil {
		s.limiter.fail("addr:"+addr, now)
		s.limiter.fail("login:"+login, now)
		s.cfg.Logger.Warn("console: sign-in failed", "code", CodeSignInFailed, "login", login, "addr", addr, "reason", s.redactErr(err).Error())
		s.renderSignIn(w, r, http.StatusUnauthorized, string(CodeSignInFailed)+": the database refused this login and password (or could not be reached)")
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = se.db.Close()
		http.Error(w, "console closed", http.StatusServiceUnavailable)
		return
	}
	s.sessions[se.id] = se
	// A sign-in in a browser that had a session ends that one.
	var old *session
	if c, err := r.Cookie(sessionCookie); err == nil && c.Value != "" {
		old = s.sessions[c.Value]
		delete(s.sessions, c.Value)
	}
	s.mu.Unlock()
	if old != nil {
		_ = old.db.Close()
	}
	s.cfg.Logger.Info("console: signed in", "login", se.login, "addr", addr)
	http.SetCookie(w, s.cookie(preCookie, "", -1))
	http.SetCookie(w, s.cookie(sessionCookie, se.id, 0))
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// open connects as login with password: a small pool of the person's own,
// checked with a ping and the schema check every outboxctl command makes.
func (s *Server) open(ctx context.Context, login, password string) (*session, error) {
	if login == "" || len(login) > 63 || strings.ContainsAny(login, "\x00") || len(password) > 1024 {
		return nil, errors.New("empty or over-long login or password")
	}
	u, err := neturl.Parse(s.cfg.DatabaseURL)
	if err != nil {
		return nil, errors.New("database URL does not parse")
	}
	u.User = neturl.UserPassword(login, password)
	dsn := u.String()
	connector, err := pq.NewConnector(dsn)
	if err != nil {
		return nil, errors.New("database URL refused by the driver")
	}
	db := sql.OpenDB(connector)
	db.SetMaxOpenConns(s.cfg.PoolSize)
	db.SetMaxIdleConns(s.cfg.PoolSize)
	db.SetConnMaxIdleTime(s.cfg.IdleTimeout)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var who string
	if err := db.QueryRowContext(ctx, `SELECT session_user`).Scan(&who); err != nil {
		_ = db.Close()
		return nil, errors.New(strings.ReplaceAll(s.redactErr(err).Error(), password, "xxxxx"))
	}
	if err := migrations.Check(ctx, db); err != nil {
		_ = db.Close()
		return nil, errors.New(strings.ReplaceAll(s.redactErr(err).Error(), password, "xxxxx"))
	}
	now := s.cfg.Now()
	return &session{id: randomToken(), csrf: randomToken(), login: who, db: db, created: now, seen: now, ov: &overviewCache{}}, nil
}

func sameToken(a, b string) bool {
	return a != "" && subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// current returns the live session of r, touching it, or nil. An expired
// session is ended (its pool closed) here.
func (s *Server) current(r *http.Request) *session {
	c, err := r.Cookie(sessionCookie)
	if err != nil || c.Value == "" {
		return nil
	}
	now := s.cfg.Now()
	s.mu.Lock()
	se := s.sessions[c.Value]
	if se == nil {
		s.mu.Unlock()
		return nil
	}
	if s.expired(se, now) {
		delete(s.sessions, se.id)
		s.mu.Unlock()
		s.cfg.Logger.Info("console: session expired", "login", se.login)
		_ = se.db.Close()
		return nil
	}
	se.seen = now
	s.mu.Unlock()
	return se
}

func (s *Server) expired(se *session, now time.Time) bool {
	return now.Sub(se.seen) >= s.cfg.IdleTimeout || now.Sub(se.created) >= s.cfg.MaxSession
}

// expire ends every expired session.
func (s *Server) expire() {
	now := s.cfg.Now()
	s.mu.Lock()
	var gone []*session
	for id, se := range s.sessions {
		if s.expired(se, now) {
			delete(s.sessions, id)
			gone = append(gone, se)
		}
	}
	s.mu.Unlock()
	for _, se := range gone {
		s.cfg.Logger.Info("console: session expired", "login", se.login)
		_ = se.db.Close()
	}
}

// Sessions returns how many sessions are live (for tests and the log).
func (s *Server) Sessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sessions)
}

// viewerOf returns who r is answered for, or nil when r needs a sign-in.
func (s *Server) viewerOf(r *http.Request) *viewer {
	if s.ReadOnly() {
		return &viewer{login: "read-only", db: s.cfg.ReadOnlyDB, readOnly: true, ov: s.readOnlyOverview}
	}
	se := s.current(r)
	if se == nil {
		return nil
	}
	return &viewer{login: se.login, db: se.db, csrf: se.csrf, ov: se.ov}
}

// page wraps a GET handler: a viewer is required (a redirect to the sign-in
// page otherwise).
func (s *Server) page(fn func(w http.ResponseWriter, r *http.Request, v *viewer) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		v := s.viewerOf(r)
		if v == nil {
			http.Redirect(w, r, "/signin", http.StatusSeeOther)
			return
		}
		if err := fn(w, r, v); err != nil {
			s.fail(w, r, v, err)
		}
	}
}

// action wraps a state-changing (POST) handler: refused in read-only mode,
// without a live session, and without the session's CSRF token or from
// another origin.
func (s *Server) action(fn func(w http.ResponseWriter, r *http.Request, v *viewer) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if s.ReadOnly() {
			s.cfg.Logger.Warn("console: action refused: read-only", "code", CodeReadOnly, "path", r.URL.Path)
			s.fail(w, r, s.viewerOf(r), refuse(http.StatusForbidden, CodeReadOnly, "this console is read-only: nothing can be changed from it"))
			return
		}
		se := s.current(r)
		if se == nil {
			s.cfg.Logger.Warn("console: action refused: no live session", "code", CodeSessionRequired, "path", r.URL.Path)
			s.fail(w, r, nil, refuse(http.StatusUnauthorized, CodeSessionRequired, "no live session (signed out, or expired): sign in again"))
			return
		}
		v := &viewer{login: se.login, db: se.db, csrf: se.csrf}
		if o := r.Header.Get("Origin"); o != "" && o != "null" && !sameOrigin(o, r) {
			s.cfg.Logger.Warn("console: action refused: cross-origin", "code", CodeCSRF, "login", v.login, "path", r.URL.Path)
			s.fail(w, r, v, refuse(http.StatusForbidden, CodeCSRF, "a request from another origin"))
			return
		}
		if !sameToken(se.csrf, r.PostFormValue("csrf")) {
			s.cfg.Logger.Warn("console: action refused: CSRF token missing or wrong", "code", CodeCSRF, "login", v.login, "path", r.URL.Path)
			s.fail(w, r, v, refuse(http.StatusForbidden, CodeCSRF, "the form's CSRF token is missing or wrong: reload the page and try again"))
			return
		}
		if err := fn(w, r, v); err != nil {
			s.fail(w, r, v, err)
		}
	}
}

func sameOrigin(origin string, r *http.Request) bool {
	u, err := neturl.Parse(origin)
	return err == nil && u.Host == r.Host
}

func (s *Server) signOut(w http.ResponseWriter, r *http.Request, v *viewer) error {
	c, _ := r.Cookie(sessionCookie)
	s.mu.Lock()
	se := s.sessions[c.Value]
	delete(s.sessions, c.Value)
	s.mu.Unlock()
	if se != nil {
		_ = se.db.Close()
	}
	s.cfg.Logger.Info("console: signed out", "login", v.login)
	http.SetCookie(w, s.cookie(sessionCookie, "", -1))
	http.Redirect(w, r, "/signin", http.StatusSeeOther)
	return nil
}
