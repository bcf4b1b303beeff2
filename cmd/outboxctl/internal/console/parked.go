package console

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

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
