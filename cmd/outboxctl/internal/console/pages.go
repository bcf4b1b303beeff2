package console

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// pageData is what every page template gets.
type pageData struct {
	Title    string
	Nav      string
	Login    string
	CSRF     string
	ReadOnly bool
	Error    string
	Notice   string
	Refresh  bool // reload every few seconds (an execution running)
	Data     any
}

var funcs = template.FuncMap{
	"text": visible,
	"ts": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"age": func(seconds float64) string {
		return (time.Duration(seconds * float64(time.Second))).Round(time.Second).String()
	},
	"bytes": bytesText,
	"add":   func(a int64, b int) int64 { return a + int64(b) },
	"deref": func(p *int64) int64 { return *p },
}

// parsePages parses each page with the layout.
func parsePages() (map[string]*template.Template, error) {
	names, err := fs.Glob(assets, "assets/templates/*.html")
	if err != nil {
		return nil, err
	}
	pages := map[string]*template.Template{}
	for _, n := range names {
		base := strings.TrimSuffix(n[strings.LastIndex(n, "/")+1:], ".html")
		if base == "layout" {
			continue
		}
		t, err := template.New(base).Funcs(funcs).ParseFS(assets, "assets/templates/layout.html", n)
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", n, err)
		}
		pages[base] = t
	}
	return pages, nil
}

func (s *Server) render(w http.ResponseWriter, status int, page string, d *pageData) {
	d.ReadOnly = s.ReadOnly()
	var buf bytes.Buffer
	if err := s.pages[page].ExecuteTemplate(&buf, "layout", d); err != nil {
		s.cfg.Logger.Error("console: render", "page", page, "err", s.redactErr(err).Error())
		http.Error(w, "console: the page could not be rendered", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fail answers a refused or failed request with its code and redacted text.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, v *viewer, err error) {
	code := statusOf(err)
	d := &pageData{Title: "Refused", Error: s.errText(err)}
	if v != nil {
		d.Login, d.CSRF = v.login, v.csrf
	}
	if code >= 500 {
		s.cfg.Logger.Error("console: request failed", "path", r.URL.Path, "login", d.Login, "code", outbox.CodeOf(err), "err", d.Error)
	}
	s.render(w, code, "error", d)
}

func (v *viewer) data(title, nav string) *pageData {
	return &pageData{Title: title, Nav: nav, Login: v.login, CSRF: v.csrf}
}

// visible returns application text with every character a terminal or a
// reader could be fooled by written as a Go escape (ESC as \x1b, newlines,
// bidi controls, bytes that are not UTF-8), as outboxctl prints it. HTML
// escaping is the template's: the two together show a payload, a header or a
// topic holding an escape sequence or <script> as text.
func visible(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == ' ' || unicode.IsPrint(r):
			b.WriteRune(r)
		default:
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		}
		i += size
	}
	return b.String()
}

func bytesText(n int64) string {
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

func perMinute(ctx context.Context, db *sql.DB, q string, since time.Time) (map[time.Time]int64, error) {
	rows, err := db.QueryContext(ctx, q, since)
	if err != nil {
		return nil, fmt.Errorf("console: per-minute counts: %w", err)
	}
	defer rows.Close()
	out := map[time.Time]int64{}
	for rows.Next() {
		var (
			m time.Time
			n int64
		)
		if err := rows.Scan(&m, &n); err != nil {
			return nil, err
		}
		out[m.UTC()] = n
	}
	return out, rows.Err()
}
