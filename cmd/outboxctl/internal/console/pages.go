package console

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/journal"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/status"
)

// PayloadPreview is how many payload bytes the inspector shows.
const PayloadPreview = 4096

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

// parkedFilter is the parked page's filter, as its query string carries it.
type parkedFilter struct {
	Destination string
	Tenant      string
	FailureCode string
	Status      string // "", FAILED or EXHAUSTED
	Since       string
	Until       string
}

// parseFilter reads the filter from form values (a query string or a POSTed
// form: the plan action takes the same fields).
func parseFilter(vals url.Values) (parkedFilter, journal.Filter, error) {
	pf := parkedFilter{
		Destination: vals.Get("destination"), Tenant: vals.Get("tenant"), FailureCode: vals.Get("code"),
		Status: strings.ToUpper(strings.TrimSpace(vals.Get("status"))), Since: strings.TrimSpace(vals.Get("since")), Until: strings.TrimSpace(vals.Get("until")),
	}
	jf := journal.Filter{Destination: pf.Destination, Tenant: pf.Tenant, FailureCode: pf.FailureCode}
	switch pf.Status {
	case "":
	case string(envelope.StatusFailed), string(envelope.StatusExhausted):
		jf.Statuses = []envelope.Status{envelope.Status(pf.Status)}
	default:
		return pf, jf, refuse(http.StatusBadRequest, CodeBadRequest, "status %q is not FAILED or EXHAUSTED (parked rows only)", visible(pf.Status))
	}
	for _, t := range []struct {
		name, v string
		into    *time.Time
	}{{"since", pf.Since, &jf.CreatedAfter}, {"until", pf.Until, &jf.CreatedBefore}} {
		if t.v == "" {
			continue
		}
		parsed, err := parseTime(t.v)
		if err != nil {
			return pf, jf, refuse(http.StatusBadRequest, CodeBadRequest, "%s %q is not a time: use RFC 3339 (2030-01-02T15:04:05Z) or 2030-01-02T15:04 (UTC)", t.name, visible(t.v))
		}
		*t.into = parsed
	}
	if err := jf.Validate(); err != nil {
		return pf, jf, &pageErr{status: http.StatusBadRequest, err: err}
	}
	return pf, jf, nil
}

func parseTime(v string) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	return time.ParseInLocation("2006-01-02T15:04", v, time.UTC)
}

// query is the filter as a query string (links to the next page keep it).
func (f parkedFilter) query() url.Values {
	q := url.Values{}
	for k, v := range map[string]string{"destination": f.Destination, "tenant": f.Tenant, "code": f.FailureCode, "status": f.Status, "since": f.Since, "until": f.Until} {
		if v != "" {
			q.Set(k, v)
		}
	}
	return q
}

type parkedRow struct {
	MessageID, Status, Destination, Tenant, Code string
	Seq                                          int64
	Attempts                                     int
	Created, Parked                              time.Time
	Size                                         int64
	Link                                         string
}

type parkedData struct {
	Filter   parkedFilter
	Matching int64
	Digest   string
	Rows     []parkedRow
	First    int64 // position of the first row shown (1-based)
	Next     string
	FirstURL string
}

func (f parkedFilter) args(jf journal.Filter) []any {
	n := jf.Normalize()
	st := make([]string, len(n.Statuses))
	for i, s := range n.Statuses {
		st[i] = string(s)
	}
	null := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	nt := func(t time.Time) any {
		if t.IsZero() {
			return nil
		}
		return t
	}
	return []any{pq.Array(st), null(n.Destination), null(n.Tenant), null(n.FailureCode), nt(n.CreatedAfter), nt(n.CreatedBefore)}
}

func (s *Server) parked(w http.ResponseWriter, r *http.Request, v *viewer) error {
	ctx := r.Context()
	pf, jf, err := parseFilter(r.URL.Query())
	if err != nil {
		return err
	}
	var after, shown int64
	if a := r.URL.Query().Get("after"); a != "" {
		if after, err = strconv.ParseInt(a, 10, 64); err != nil || after < 0 {
			return refuse(http.StatusBadRequest, CodeBadRequest, "after %q is not a seq cursor", visible(a))
		}
	}
	if n := r.URL.Query().Get("shown"); n != "" {
		if shown, err = strconv.ParseInt(n, 10, 64); err != nil || shown < 0 {
			return refuse(http.StatusBadRequest, CodeBadRequest, "shown %q is not a count", visible(n))
		}
	}
	// The count is the journal's own dry run of this filter: what a plan
	// made from this page covers, every page of it.
	j, err := journal.New(v.db, journal.Config{Owner: "console"})
	if err != nil {
		return err
	}
	plan, err := j.PlanRedrive(ctx, jf)
	if err != nil {
		return err
	}
	d := parkedData{Filter: pf, Matching: plan.Matching, Digest: plan.Digest, First: shown + 1}
	args := append(pf.args(jf), after, s.cfg.PageSize)
	rows, err := v.db.QueryContext(ctx, parkedPageQuery, args...)
	if err != nil {
		return fmt.Errorf("console: parked rows: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var p parkedRow
		if err := rows.Scan(&p.MessageID, &p.Seq, &p.Status, &p.Destination, &p.Tenant, &p.Code, &p.Attempts, &p.Created, &p.Parked, &p.Size); err != nil {
			return err
		}
		p.Link = "/row?" + url.Values{"id": {p.MessageID}}.Encode()
		d.Rows = append(d.Rows, p)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	q := pf.query()
	d.FirstURL = "/parked?" + q.Encode()
	if len(d.Rows) == s.cfg.PageSize && shown+int64(len(d.Rows)) < plan.Matching {
		q.Set("after", strconv.FormatInt(d.Rows[len(d.Rows)-1].Seq, 10))
		q.Set("shown", strconv.FormatInt(shown+int64(len(d.Rows)), 10))
		d.Next = "/parked?" + q.Encode()
	}
	pd := v.data("Parked rows", "parked")
	pd.Data = d
	s.render(w, http.StatusOK, "parked", pd)
	return nil
}

type field struct{ Name, Value string }

type rowData struct {
	Columns     []field
	Headers     []field
	Size        int
	Kind        string // text or binary (hex)
	Preview     string
	Cut         bool
	ParkedQuery string // the parked filter of this row's destination and code
}

func (s *Server) row(w http.ResponseWriter, r *http.Request, v *viewer) error {
	id := r.URL.Query().Get("id")
	row, err := status.Message(r.Context(), v.db, id)
	if outbox.CodeOf(err) == status.CodeMessageNotFound || outbox.CodeOf(err) == outbox.CodeMessageIDRequired {
		return &pageErr{status: http.StatusNotFound, err: err}
	}
	if err != nil && row.MessageID == "" {
		return err
	}
	d := rowData{Size: len(row.Payload)}
	for _, c := range columns(row) {
		d.Columns = append(d.Columns, c)
	}
	keys := make([]string, 0, len(row.Headers))
	for k := range row.Headers {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		d.Headers = append(d.Headers, field{k, row.Headers[k]})
	}
	shown := row.Payload
	if len(shown) > PayloadPreview {
		shown, d.Cut = shown[:PayloadPreview], true
		for k := 0; k < utf8.UTFMax && len(shown) > 0 && !utf8.Valid(shown) && utf8.Valid(row.Payload); k++ {
			shown = shown[:len(shown)-1]
		}
	}
	if utf8.Valid(row.Payload) {
		d.Kind, d.Preview = "text", visible(string(shown))
	} else {
		d.Kind, d.Preview = "binary, shown as hex", hex.EncodeToString(shown)
	}
	pd := v.data("Row "+visible(row.MessageID), "parked")
	if err != nil {
		pd.Error = s.errText(err) // a corrupt row is shown, then reported
	}
	pd.Data = d
	s.render(w, http.StatusOK, "row", pd)
	return nil
}

func tstr(t time.Time) string {
	if t.IsZero() {
		return "NULL"
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func sstr(s string) string {
	if s == "" {
		return "NULL"
	}
	return s
}

// columns lists every column of the row in schema order, as outboxctl
// inspect prints them.
func columns(r envelope.Row) []field {
	agg := "NULL"
	if r.AggregateVersion != nil {
		agg = strconv.FormatInt(*r.AggregateVersion, 10)
	}
	return []field{
		{"message_id", r.MessageID}, {"destination", r.Destination}, {"status", string(r.Status)},
		{"seq", strconv.FormatInt(r.Seq, 10)}, {"created_at", tstr(r.CreatedAt)}, {"occurred_at", tstr(r.OccurredAt)},
		{"published_at", tstr(r.PublishedAt)}, {"attempts", strconv.Itoa(r.Attempts)}, {"next_attempt_at", tstr(r.NextAttemptAt)},
		{"lease_owner", sstr(r.LeaseOwner)}, {"lease_token", strconv.FormatInt(r.LeaseToken, 10)}, {"lease_expires_at", tstr(r.LeaseExpiresAt)},
		{"last_failure_code", sstr(r.LastFailureCode)}, {"last_failure_detail", sstr(r.LastFailureDetail)},
		{"last_attempt_at", tstr(r.LastAttemptAt)}, {"parked_at", tstr(r.ParkedAt)}, {"producer", sstr(r.Producer)},
		{"correlation_id", sstr(r.CorrelationID)}, {"causation_id", sstr(r.CausationID)}, {"tenant", sstr(r.Tenant)},
		{"partition_key", sstr(r.PartitionKey)}, {"ordering_key", sstr(r.OrderingKey)}, {"routing_key", r.RoutingKey},
		{"traceparent", sstr(r.Traceparent)}, {"tracestate", sstr(r.Tracestate)}, {"baggage", sstr(r.Baggage)},
		{"schema_subject", sstr(r.SchemaSubject)}, {"schema_version", sstr(r.SchemaVersion)}, {"content_type", sstr(r.ContentType)},
		{"message_type", sstr(r.MessageType)}, {"aggregate_type", sstr(r.AggregateType)}, {"aggregate_id", sstr(r.AggregateID)},
		{"aggregate_version", agg},
	}
}

type relayRow struct {
	relaymode.Heartbeat
	Live  bool
	Lanes int // lanes this relay owns under a live lease
}

// laneOwner is one relay's share of the lanes.
type laneOwner struct {
	Owner   string
	Lanes   []int
	Held    int64 // rows in flight, listed in its lanes
	Expires time.Time
}

type breakerRow struct {
	Owner, Destination, LastError string
	OpenedAt                      time.Time
	HeldOff                       int64
}

type relaysData struct {
	At            time.Time
	Mode          relaymode.ModeRecord
	Relays        []relayRow
	CDC           []relayRow
	Breakers      []breakerRow
	Slots         []status.Slot
	BudgetsDiffer bool
	HeldOffCapped bool // the held-off counts stopped at heldOffLimit rows
	Ready         bool
	ReadyWhy      string
	LaneTable     bool
	Fence         string
	LaneCount     int
	LaneOwners    []laneOwner
	FreeLanes     []int // no live owner
	LanesErr      string
	CDCLag        string
}

// relays reads the fleet, not the backlog: the relay mode, the live
// heartbeats (relaymode), the open breakers with the rows each holds off,
// the replication slots (status.ReadSlots), in one read-only snapshot.
// Every read is of a small table or an index probe, so the page stays fast
// on any backlog.
func (s *Server) relays(w http.ResponseWriter, r *http.Request, v *viewer) error {
	ctx := r.Context()
	tx, err := v.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return fmt.Errorf("console: relays: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	var d relaysData
	if err := tx.QueryRowContext(ctx, `SELECT now()`).Scan(&d.At); err != nil {
		return fmt.Errorf("console: relays: %w", err)
	}
	if d.Mode, err = relaymode.ReadMode(ctx, tx); err != nil {
		return err
	}
	live, err := relaymode.LiveRelays(ctx, tx, d.At)
	if err != nil {
		return err
	}
	budget := 0
	for _, h := range live {
		d.Relays = append(d.Relays, relayRow{Heartbeat: h, Live: h.ExpiresAt.After(d.At)})
		if h.MaxAttempts != 0 {
			d.BudgetsDiffer = d.BudgetsDiffer || (budget != 0 && budget != h.MaxAttempts)
			budget = h.MaxAttempts
		}
	}
	cdc, err := relaymode.LiveCDCConsumers(ctx, tx, d.At)
	if err != nil {
		return err
	}
	for _, h := range cdc {
		d.CDC = append(d.CDC, relayRow{Heartbeat: h, Live: h.ExpiresAt.After(d.At)})
	}
	rows, err := tx.QueryContext(ctx, breakersQuery, d.At)
	if err != nil {
		return fmt.Errorf("console: breakers: %w", err)
	}
	for rows.Next() {
		var b breakerRow
		if err := rows.Scan(&b.Owner, &b.Destination, &b.OpenedAt, &b.LastError); err != nil {
			rows.Close()
			return err
		}
		d.Breakers = append(d.Breakers, b)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	if len(d.Breakers) > 0 {
		dests := make([]string, 0, len(d.Breakers))
		for _, b := range d.Breakers {
			dests = append(dests, b.Destination)
		}
		held := map[string]int64{}
		rows, err := tx.QueryContext(ctx, heldOffQuery, pq.Array(dests), heldOffLimit)
		if err != nil {
			return fmt.Errorf("console: held-off rows: %w", err)
		}
		for rows.Next() {
			var (
				dest string
				n    int64
			)
			if err := rows.Scan(&dest, &n); err != nil {
				rows.Close()
				return err
			}
			held[dest] = n
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		var total int64
		for _, n := range held {
			total += n
		}
		d.HeldOffCapped = total >= heldOffLimit
		for i := range d.Breakers {
			d.Breakers[i].HeldOff = held[d.Breakers[i].Destination]
		}
	}
	if d.Slots, err = status.ReadSlots(ctx, tx); err != nil {
		return err
	}
	// Readiness as the relays' /readyz sees the fleet: the mode's kind of
	// relay has a live heartbeat.
	switch {
	case d.Mode.Mode == relaymode.ModeCDC && len(d.CDC) > 0, d.Mode.Mode != relaymode.ModeCDC && len(d.Relays) > 0:
		d.Ready, d.ReadyWhy = true, fmt.Sprintf("relay mode %s with a live relay of that kind", d.Mode.Mode)
	default:
		d.ReadyWhy = fmt.Sprintf("relay mode %s and no live relay of that kind: nothing is being delivered", d.Mode.Mode)
	}
	if d.Mode.Mode == relaymode.ModeCDC {
		var oldest time.Time
		switch err := tx.QueryRowContext(ctx, oldestUndeliveredQuery).Scan(&oldest); {
		case errors.Is(err, sql.ErrNoRows):
			d.CDCLag = "0s (nothing waiting)"
		case err != nil:
			return fmt.Errorf("console: CDC lag: %w", err)
		default:
			d.CDCLag = d.At.Sub(oldest).Round(time.Second).String()
		}
	}
	if err := tx.QueryRowContext(ctx, laneTableQuery).Scan(&d.LaneTable, &d.Fence); err != nil {
		return fmt.Errorf("console: lanes: %w", err)
	}
	if d.LaneTable {
		// Last in the transaction: a login without SELECT on the lanes
		// table is told so, and nothing after it needs the transaction.
		if err := s.readLanes(ctx, tx, &d); err != nil {
			d.LanesErr = s.grantText(err, "messaging_relay_lane", "no role's block grants it yet; grant it to see the lanes")
		}
	}
	pd := v.data("Relays", "relays")
	pd.Data = d
	s.render(w, http.StatusOK, "relays", pd)
	return nil
}

func (s *Server) readLanes(ctx context.Context, tx *sql.Tx, d *relaysData) error {
	rows, err := tx.QueryContext(ctx, lanesQuery)
	if err != nil {
		return err
	}
	defer rows.Close()
	owners := map[string]*laneOwner{}
	for rows.Next() {
		var (
			lane    int
			owner   string
			epoch   int64
			expires sql.NullTime
			held    int64
		)
		if err := rows.Scan(&lane, &owner, &epoch, &expires, &held); err != nil {
			return err
		}
		d.LaneCount++
		if owner == "" || !expires.Valid || !expires.Time.After(d.At) {
			d.FreeLanes = append(d.FreeLanes, lane)
			continue
		}
		o := owners[owner]
		if o == nil {
			o = &laneOwner{Owner: owner, Expires: expires.Time}
			owners[owner] = o
		}
		o.Lanes = append(o.Lanes, lane)
		o.Held += held
		if expires.Time.Before(o.Expires) {
			o.Expires = expires.Time
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for _, o := range owners {
		d.LaneOwners = append(d.LaneOwners, *o)
	}
	slices.SortFunc(d.LaneOwners, func(a, b laneOwner) int { return strings.Compare(a.Owner, b.Owner) })
	for i := range d.Relays {
		if o := owners[d.Relays[i].Owner]; o != nil {
			d.Relays[i].Lanes = len(o.Lanes)
		}
	}
	return nil
}
