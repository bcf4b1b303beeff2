package console

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// proposal is a plan made in the console and waiting for its approval: the
// dry run of an operation over a filter, under a fresh ticket, with the
// login that made it (who may not approve it). Proposals live in the
// console's memory; once approved, the approval (in the database) is what
// the execution reads.
type proposal struct {
	Ticket    string
	Operation string
	Filter    journal.Filter
	FilterTxt string
	Digest    string
	Matching  int64
	PlannedBy string
	PlannedAt time.Time
}

// execution is the console's view of a ticket it is executing or executed:
// the journal row is the truth about progress, this keeps the error of a
// run that stopped.
type execution struct {
	mu      sync.Mutex
	by      string
	running bool
	items   int64
	planned int64
	err     error
	done    chan struct{} // closed when the run returns
}

func newTicket(now time.Time) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return "console-" + now.UTC().Format("20060102") + "-" + hex.EncodeToString(b)
}

func ticketLink(t string) string { return "/ops/ticket?" + url.Values{"t": {t}}.Encode() }

// plan makes the dry run of a redrive or purge of the parked page's filter
// (journal PlanRedrive/PlanPurge, in the viewer's name), keeps it under a
// new ticket and shows it for approval.
func (s *Server) plan(w http.ResponseWriter, r *http.Request, v *viewer) error {
	op := r.PostFormValue("op")
	if op != journal.OpRedrive && op != journal.OpPurge {
		return refuse(http.StatusBadRequest, CodeBadRequest, "operation %q is not %s or %s", visible(op), journal.OpRedrive, journal.OpPurge)
	}
	_, jf, err := parseFilter(r.PostForm)
	if err != nil {
		return err
	}
	j, err := journal.New(v.db, journal.Config{Owner: "console"})
	if err != nil {
		return err
	}
	planFn := j.PlanRedrive
	if op == journal.OpPurge {
		planFn = j.PlanPurge
	}
	p, err := planFn(r.Context(), jf)
	if err != nil {
		return err
	}
	filter, err := json.Marshal(p.Filter)
	if err != nil {
		return err
	}
	now := s.cfg.Now()
	pr := &proposal{Ticket: newTicket(now), Operation: op, Filter: p.Filter, FilterTxt: string(filter), Digest: p.Digest,
		Matching: p.Matching, PlannedBy: v.login, PlannedAt: now}
	s.mu.Lock()
	s.plans[pr.Ticket] = pr
	// Bound what waits in memory: the oldest plans go first.
	if len(s.plans) > 1000 {
		var oldest *proposal
		for _, q := range s.plans {
			if oldest == nil || q.PlannedAt.Before(oldest.PlannedAt) {
				oldest = q
			}
		}
		delete(s.plans, oldest.Ticket)
	}
	s.mu.Unlock()
	s.cfg.Logger.Info("console: planned", "login", v.login, "operation", op, "ticket", pr.Ticket, "digest", pr.Digest, "matching", pr.Matching)
	http.Redirect(w, r, ticketLink(pr.Ticket), http.StatusSeeOther)
	return nil
}

func (s *Server) proposal(ticket string) *proposal {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.plans[ticket]
}

// approve records the approval of a plan this console holds, as the
// viewer's login (journal.Approve: the database writes session_user). The
// login that planned it is refused (CONSOLE_SELF_APPROVAL); a login without
// INSERT on messaging_admin_approval is refused by the database.
func (s *Server) approve(w http.ResponseWriter, r *http.Request, v *viewer) error {
	ticket := r.PostFormValue("ticket")
	pr := s.proposal(ticket)
	if pr == nil {
		return refuse(http.StatusNotFound, CodeUnknownTicket, "this console holds no plan under ticket %q: plan it again from the parked rows page", visible(ticket))
	}
	if r.PostFormValue("digest") != pr.Digest {
		return refuse(http.StatusConflict, CodeBadRequest, "the page approved digest %q, the plan under ticket %s is %s: reload the ticket page", visible(r.PostFormValue("digest")), ticket, pr.Digest)
	}
	if pr.PlannedBy == v.login {
		s.cfg.Logger.Warn("console: self-approval refused", "code", CodeSelfApproval, "login", v.login, "ticket", ticket)
		return refuse(http.StatusForbidden, CodeSelfApproval, "%s planned ticket %s and cannot approve it: another login approves it", v.login, ticket)
	}
	j, err := journal.New(v.db, journal.Config{Owner: "console"})
	if err != nil {
		return err
	}
	a, err := j.Approve(r.Context(), ticket, pr.Operation, pr.Filter)
	if err != nil {
		s.cfg.Logger.Warn("console: approval refused", "code", outbox.CodeOf(err), "login", v.login, "ticket", ticket, "err", s.errText(err))
		return &pageErr{status: refusalStatus(err), err: err}
	}
	s.cfg.Logger.Info("console: approved", "login", a.ApprovedBy, "ticket", ticket, "count", a.Count, "digest", a.Digest)
	http.Redirect(w, r, ticketLink(ticket), http.StatusSeeOther)
	return nil
}

// refusalStatus is the HTTP status of a journal or database refusal.
func refusalStatus(err error) int {
	var pe *pq.Error
	if errors.As(err, &pe) && pe.Code == "42501" {
		return http.StatusForbidden
	}
	switch outbox.CodeOf(err) {
	case journal.CodeAlreadyExecuted, journal.CodeInFlight, journal.CodeAlreadyApproved, journal.CodeApprovalExceeded,
		journal.CodePlanMismatch, journal.CodeLeaseLost:
		return http.StatusConflict
	case journal.CodeNotApproved:
		return http.StatusForbidden
	}
	return http.StatusInternalServerError
}

// execute runs the approved plan of a ticket through the journal, in the
// viewer's name, exactly as outboxctl redrive|purge --ticket T
// --expect-digest D does: the operation and filter are the approval's, the
// journal refuses a ticket already executed or in flight. Refusals come
// back in the response; once the first batch is committed the execution
// goes on in the background and the ticket page shows its progress.
func (s *Server) execute(w http.ResponseWriter, r *http.Request, v *viewer) error {
	ticket := r.PostFormValue("ticket")
	if ticket == "" {
		return refuse(http.StatusBadRequest, CodeBadRequest, "no ticket")
	}
	j, err := journal.New(v.db, journal.Config{Owner: "console:" + v.login + ":" + ticket, RequireApproval: true})
	if err != nil {
		return err
	}
	a, err := j.FindApproval(r.Context(), ticket)
	if err != nil {
		return &pageErr{status: refusalStatus(err), err: err}
	}
	if d := r.PostFormValue("digest"); d != a.Digest {
		return refuse(http.StatusConflict, CodeBadRequest, "the page executes digest %q, ticket %s approved %s: reload the ticket page", visible(d), ticket, a.Digest)
	}
	run := j.Redrive
	if a.Operation == journal.OpPurge {
		run = j.Purge
	}
	ex := &execution{by: v.login, running: true, done: make(chan struct{})}
	started := make(chan struct{})
	var once sync.Once
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return refuse(http.StatusServiceUnavailable, CodeBadRequest, "the console is closing")
	}
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		defer close(ex.done)
		// Not the request's context: the execution outlives the response.
		// It stops at a checkpoint when the console closes, or when the
		// session's pool is closed (sign-out, expiry), and resumes by
		// executing the ticket again.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-s.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		out, err := run(ctx, ticket, a.Filter, journal.Options{Progress: func(p journal.Progress) error {
			ex.mu.Lock()
			ex.items, ex.planned = p.Items, p.Planned
			ex.mu.Unlock()
			once.Do(func() { close(started) })
			return nil
		}})
		ex.mu.Lock()
		ex.running, ex.err = false, err
		if err == nil {
			ex.items, ex.planned = out.Items, out.Plan.Matching
		}
		ex.mu.Unlock()
		if err != nil {
			s.cfg.Logger.Warn("console: execution stopped", "code", outbox.CodeOf(err), "login", v.login, "ticket", ticket, "err", s.errText(err))
		} else {
			s.cfg.Logger.Info("console: executed", "login", v.login, "ticket", ticket, "operation", a.Operation, "items", out.Items)
		}
		once.Do(func() { close(started) })
	}()
	select {
	case <-started:
	case <-r.Context().Done():
		return r.Context().Err()
	}
	ex.mu.Lock()
	running, err, items := ex.running, ex.err, ex.items
	ex.mu.Unlock()
	if !running && err != nil && items == 0 {
		// Refused before it began (already executed, in flight, not
		// approved, more rows than approved): nothing ran.
		return &pageErr{status: refusalStatus(err), err: err}
	}
	s.mu.Lock()
	s.runs[ticket] = ex
	if len(s.runs) > 1000 {
		// Keep the running ones; the journal keeps every finished one.
		for t, x := range s.runs {
			x.mu.Lock()
			finished := !x.running
			x.mu.Unlock()
			if finished && t != ticket {
				delete(s.runs, t)
			}
		}
	}
	s.mu.Unlock()
	http.Redirect(w, r, ticketLink(ticket), http.StatusSeeOther)
	return nil
}

type approvalRow struct {
	Ticket, Operation, Digest, Filter, By string
	MaxSeq, Count                         int64
	ParkedBefore, At                      time.Time
}

type operationRow struct {
	Ticket, Operation, State, Owner, FailureCode, FailureDetail, ExecutedBy, ForcedBy string
	Items                                                                             int64
	Started, Updated, Completed                                                       time.Time
}

type opsData struct {
	Plans          []*proposal
	Approvals      []approvalRow
	ApprovalsErr   string
	Operations     []operationRow
	OperationsErr  string
	TicketLinkBase string
}

func readApprovals(ctx context.Context, db *sql.DB, q string, args ...any) ([]approvalRow, error) {
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []approvalRow
	for rows.Next() {
		var a approvalRow
		if err := rows.Scan(&a.Ticket, &a.Operation, &a.Digest, &a.Filter, &a.MaxSeq, &a.ParkedBefore, &a.Count, &a.By, &a.At); err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, rows.Err()
}

func readOperations(ctx context.Context, db *sql.DB) ([]operationRow, error) {
	rows, err := db.QueryContext(ctx, operationsQuery)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []operationRow
	for rows.Next() {
		var o operationRow
		if err := rows.Scan(&o.Ticket, &o.Operation, &o.State, &o.Owner, &o.Items, &o.Started, &o.Updated, &o.Completed,
			&o.FailureCode, &o.FailureDetail, &o.ExecutedBy, &o.ForcedBy); err != nil {
			return nil, err
		}
		if o.Completed.Unix() == 0 {
			o.Completed = time.Time{}
		}
		out = append(out, o)
	}
	return out, rows.Err()
}

// grantText says what a permission error means on a page that shows what
// the login may read; who names the roles that hold the grant.
func (s *Server) grantText(err error, table, who string) string {
	var pe *pq.Error
	if errors.As(err, &pe) && pe.Code == "42501" {
		return "your login holds no SELECT on " + table + " (docs/SECURITY.md: " + who + ")"
	}
	return s.errText(err)
}

func (s *Server) ops(w http.ResponseWriter, r *http.Request, v *viewer) error {
	ctx := r.Context()
	var d opsData
	s.mu.Lock()
	for _, p := range s.plans {
		d.Plans = append(d.Plans, p)
	}
	s.mu.Unlock()
	slices.SortFunc(d.Plans, func(a, b *proposal) int { return b.PlannedAt.Compare(a.PlannedAt) })
	var err error
	if d.Approvals, err = readApprovals(ctx, v.db, approvalsQuery); err != nil {
		d.ApprovalsErr = s.grantText(err, "messaging_admin_approval", "the approver and operator roles hold it")
	}
	if d.Operations, err = readOperations(ctx, v.db); err != nil {
		d.OperationsErr = s.grantText(err, "messaging_admin_operation", "the operator role holds it")
	}
	// A plan approved (by this console or otherwise) waits no more.
	approved := map[string]bool{}
	for _, a := range d.Approvals {
		approved[a.Ticket] = true
	}
	d.Plans = slices.DeleteFunc(d.Plans, func(p *proposal) bool { return approved[p.Ticket] })
	pd := v.data("Admin operations", "ops")
	pd.Data = d
	s.render(w, http.StatusOK, "ops", pd)
	return nil
}

type ticketData struct {
	Ticket      string
	Plan        *proposal
	Approval    *approvalRow
	ApprovalErr string
	Record      *journal.Record
	RecordErr   string
	Running     bool
	RunErr      string
	Items       int64
	Planned     int64
	CanApprove  bool
	CanExecute  bool
	CLI         string
}

func (s *Server) ticket(w http.ResponseWriter, r *http.Request, v *viewer) error {
	ctx := r.Context()
	t := r.URL.Query().Get("t")
	if t == "" || len(t) > 200 {
		return refuse(http.StatusBadRequest, CodeBadRequest, "no ticket")
	}
	d := ticketData{Ticket: t, Plan: s.proposal(t)}
	j, err := journal.New(v.db, journal.Config{Owner: "console"})
	if err != nil {
		return err
	}
	if a, err := j.FindApproval(ctx, t); err == nil {
		filter, _ := json.Marshal(a.Filter)
		d.Approval = &approvalRow{Ticket: a.Ticket, Operation: a.Operation, Digest: a.Digest, Filter: string(filter), By: a.ApprovedBy,
			MaxSeq: a.MaxSeq, Count: a.Count, ParkedBefore: a.ParkedBefore, At: a.ApprovedAt}
	} else if outbox.CodeOf(err) != journal.CodeNotApproved {
		d.ApprovalErr = s.grantText(err, "messaging_admin_approval", "the approver and operator roles hold it")
	}
	if rec, err := j.Find(ctx, t); err == nil {
		d.Record = &rec
	} else if outbox.CodeOf(err) != journal.CodeNotFound {
		d.RecordErr = s.grantText(err, "messaging_admin_operation", "the operator role holds it")
	}
	s.mu.Lock()
	ex := s.runs[t]
	s.mu.Unlock()
	if ex != nil {
		ex.mu.Lock()
		d.Running, d.Items, d.Planned = ex.running, ex.items, ex.planned
		if ex.err != nil {
			d.RunErr = s.errText(ex.err)
		}
		ex.mu.Unlock()
	}
	if d.Plan == nil && d.Approval == nil && d.Record == nil && d.ApprovalErr == "" && d.RecordErr == "" {
		return refuse(http.StatusNotFound, CodeUnknownTicket, "nothing is known of ticket %q: no plan in this console, no approval, no execution", visible(t))
	}
	d.CanApprove = !v.readOnly && d.Plan != nil && d.Approval == nil
	d.CanExecute = !v.readOnly && d.Approval != nil && !d.Running
	if d.Approval != nil {
		d.CLI = fmt.Sprintf("outboxctl %s <the filter above as flags> --ticket %s --expect-digest %s", d.Approval.Operation, t, d.Approval.Digest)
	}
	pd := v.data("Ticket "+visible(t), "ops")
	pd.Refresh = d.Running
	pd.Data = d
	s.render(w, http.StatusOK, "ticket", pd)
	return nil
}
