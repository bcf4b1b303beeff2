package status

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// CodeMessageNotFound is returned by [Message] when no row has the id.
const CodeMessageNotFound outbox.Code = "STATUS_MESSAGE_NOT_FOUND"

// ErrMessageNotFound matches [CodeMessageNotFound] with errors.Is.
var ErrMessageNotFound = &outbox.Error{Code: CodeMessageNotFound}

// Options tune [CollectWith]. The zero value is valid: every zero field takes
// the default named beside it.
type Options struct {
	// Now pins the snapshot's clock (ages, "stuck" threshold, live relays).
	// Zero means the database's now(), so ages never mix two clocks.
	Now time.Time
	// StuckAfter is how long a row may stay unpublished before its
	// correlation id counts as stuck. Default 15m.
	StuckAfter time.Duration
	// MaxGroups bounds the (status, destination, tenant) groups read.
	// Default 1000; Snapshot.Truncated says when the bound was hit.
	MaxGroups int
	// MaxFailureCodes bounds the (status, failure code) pairs read. Default 10.
	MaxFailureCodes int
	// MaxStuck bounds the stuck correlation ids read (oldest first). Default 20.
	MaxStuck int
}

// Defaults of Options' zero fields.
const (
	DefaultStuckAfter = 15 * time.Minute
	DefaultMaxGroups  = 1000
	// MaxListed is the most MaxGroups, MaxFailureCodes and MaxStuck may be.
	MaxListed              = 1_000_000
	DefaultMaxFailureCodes = 10
	DefaultMaxStuck        = 20
)

func (o Options) withDefaults() Options {
	o.StuckAfter = cmp.Or(o.StuckAfter, DefaultStuckAfter)
	o.MaxGroups = cmp.Or(o.MaxGroups, DefaultMaxGroups)
	o.MaxFailureCodes = cmp.Or(o.MaxFailureCodes, DefaultMaxFailureCodes)
	o.MaxStuck = cmp.Or(o.MaxStuck, DefaultMaxStuck)
	return o
}

// Validate refuses negative bounds and thresholds.
func (o Options) Validate() error {
	switch {
	case o.StuckAfter < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, "status.Options", "StuckAfter is %s; use a positive duration or 0 for the default", o.StuckAfter)
	case o.MaxGroups < 0, o.MaxFailureCodes < 0, o.MaxStuck < 0:
		return outbox.Errorf(outbox.CodeInvalidConfig, "status.Options", "MaxGroups, MaxFailureCodes and MaxStuck must be >= 0 (0 = default)")
	case o.MaxGroups > MaxListed, o.MaxFailureCodes > MaxListed, o.MaxStuck > MaxListed:
		return outbox.Errorf(outbox.CodeInvalidConfig, "status.Options", "MaxGroups, MaxFailureCodes and MaxStuck must be at most %d", MaxListed)
	}
	return nil
}

// Group is one (status, destination, tenant) slice of the unpublished rows.
type Group struct {
	Status      envelope.Status `json:"status"`
	Destination string          `json:"destination"`
	Tenant      string          `json:"tenant,omitempty"` // "" = no tenant
	Count       int64           `json:"count"`
	Oldest      time.Time       `json:"oldest_created_at"`
}

// Count is a labelled total.
type Count struct {
	Key   string `json:"key"`
	Count int64  `json:"count"`
}

// FailureCode is how many rows of a status carry a last_failure_code.
type FailureCode struct {
	Status envelope.Status `json:"status"`
	Code   string          `json:"code"` // "" = no code recorded
	Count  int64           `json:"count"`
}

// StuckCorrelation is a correlation id with parked rows or rows unpublished
// for longer than Options.StuckAfter.
type StuckCorrelation struct {
	CorrelationID string    `json:"correlation_id"`
	Parked        int64     `json:"parked"`       // FAILED + EXHAUSTED
	LongPending   int64     `json:"long_pending"` // PENDING, IN_FLIGHT, AMBIGUOUS past the threshold
	Oldest        time.Time `json:"oldest_created_at"`
}

// Relay is a relay with a live heartbeat: a polling relay (in
// Snapshot.Relays) or a CDC consumer (in Snapshot.CDCConsumers, with its
// slot).
type Relay struct {
	Owner       string    `json:"owner"`
	StartedAt   time.Time `json:"started_at"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
	ExpiresAt   time.Time `json:"expires_at"`
	SlotName    string    `json:"slot_name,omitempty"`
	// MaxAttempts is a polling relay's attempt budget, from its heartbeat
	// (0: not reported).
	MaxAttempts int `json:"max_attempts,omitempty"`
}

// Slot is one logical replication slot of the database, as
// pg_replication_slots reports it, with its lag in bytes of WAL. A slot keeps
// WAL from its restart position on: RetainedWALBytes is what it holds (what
// the server cannot recycle), ConfirmedLagBytes how far its consumer's
// confirmed position is behind the server's WAL. WALStatus is "reserved" or
// "extended" (fine), "unreserved" (the next checkpoint may remove WAL it
// needs) or "lost" (it can no longer be streamed; see the README).
// SafeWALSizeBytes is how much more WAL can be written before the slot is in
// danger of "lost"; nil when max_slot_wal_keep_size is -1 (no limit: the slot
// can fill the disk instead).
type Slot struct {
	Name              string `json:"slot_name"`
	Plugin            string `json:"plugin"`
	Active            bool   `json:"active"`
	WALStatus         string `json:"wal_status"`
	RetainedWALBytes  int64  `json:"retained_wal_bytes"`
	ConfirmedLagBytes int64  `json:"confirmed_lag_bytes"`
	SafeWALSizeBytes  *int64 `json:"safe_wal_size_bytes"`
	// UndeliveredBeforeSlot counts the undelivered rows committed before
	// the slot was created, which the slot does not hold (the native relay
	// refuses to start while it is above 0: wait for the forwarders to
	// deliver them before switching to CDC). nil when the relay did not
	// create the slot (no boundary is recorded).
	UndeliveredBeforeSlot *int64 `json:"undelivered_before_slot"`
}

// Snapshot is everything `outboxctl status` shows, read in one read-only
// repeatable-read transaction, so the numbers agree with each other.
type Snapshot struct {
	At            time.Time `json:"at"` // the clock the snapshot was taken by
	Mode          string    `json:"relay_mode"`
	ModeChangedAt time.Time `json:"relay_mode_changed_at"`
	ModeChangedBy string    `json:"relay_mode_changed_by"`

	Unpublished   int64   `json:"unpublished"` // every non-PUBLISHED row
	ByStatus      []Count `json:"by_status"`
	ByDestination []Count `json:"by_destination"`
	ByTenant      []Count `json:"by_tenant"` // key "" = no tenant
	Groups        []Group `json:"groups"`
	Truncated     bool    `json:"truncated"` // Groups hit Options.MaxGroups; totals cover only what was read

	// Pending counts rows still on their way: PENDING, IN_FLIGHT, AMBIGUOUS.
	Pending                 int64     `json:"pending"`
	OldestPendingAt         time.Time `json:"oldest_pending_created_at"` // zero when nothing is pending
	OldestPendingAgeSeconds float64   `json:"oldest_pending_age_seconds"`

	Ambiguous         int64              `json:"ambiguous"`
	Failed            int64              `json:"failed"`
	Exhausted         int64              `json:"exhausted"`
	FailureCodes      []FailureCode      `json:"failure_codes"`
	StuckAfterSeconds float64            `json:"stuck_after_seconds"`
	StuckCorrelations []StuckCorrelation `json:"stuck_correlations"`
	// StuckTotal counts every stuck correlation id; more than
	// len(StuckCorrelations) when Options.MaxStuck cut the list.
	StuckTotal int64   `json:"stuck_total"`
	Relays     []Relay `json:"live_relays"`
	// BudgetsDiffer is true when live relays report different MaxAttempts:
	// the budget is each relay's configuration, so the lowest parks the
	// others' rows EXHAUSTED.
	BudgetsDiffer bool `json:"budgets_differ"`
	// Breakers are the open breakers of live relays: destinations a relay
	// found unavailable as a whole (their rows wait without spending
	// attempts while it probes).
	Breakers []Breaker `json:"open_breakers"`

	// Fence is the fleet's fence scheme (ROWS or LANES), and Lanes every
	// lane with its owner, epoch and what it holds in flight (all owned
	// by nobody under ROWS).
	Fence string `json:"fence"`
	Lanes []Lane `json:"lanes"`

	// CDCConsumers are the CDC consumers with a live heartbeat (native
	// relays, Debezium connectors through their heartbeat action query).
	CDCConsumers []Relay `json:"cdc_consumers"`
	// Slots are the logical replication slots of this database.
	Slots []Slot `json:"replication_slots"`
	// Warnings are conditions an operator must act on: CDC consumers on
	// more than one slot (each delivers every insert), a CDC consumer live
	// outside CDC mode, a slot that is lost or unreserved.
	Warnings []string `json:"warnings"`
}

// Breaker is a live relay's open breaker.
type Breaker struct {
	Owner       string    `json:"owner"`
	Destination string    `json:"destination"`
	OpenedAt    time.Time `json:"opened_at"`
	LastError   string    `json:"last_error"`
}

// Collect reads a [Snapshot] with default [Options].
func Collect(ctx context.Context, db *sql.DB) (Snapshot, error) {
	return CollectWith(ctx, db, Options{})
}

// CollectWith reads a [Snapshot]. Every query is bounded and served by an
// index of messaging_outbox (see EXPLAIN.md).
func CollectWith(ctx context.Context, db *sql.DB, opts Options) (Snapshot, error) {
	if err := opts.Validate(); err != nil {
		return Snapshot{}, err
	}
	opts = opts.withDefaults()
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return Snapshot{}, fmt.Errorf("status: begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }() // read-only: nothing to keep

	var now any
	if !opts.Now.IsZero() {
		now = opts.Now
	}
	s := Snapshot{StuckAfterSeconds: opts.StuckAfter.Seconds()}
	if err := tx.QueryRowContext(ctx, dbNowQuery, now).Scan(&s.At); err != nil {
		return Snapshot{}, fmt.Errorf("status: clock: %w", err)
	}
	// From here on every query uses the pinned instant, so a row cannot be
	// "stuck" by one query's clock and not by another's.
	// The mode and the live relays are debezium's questions, asked inside
	// this snapshot's transaction so they describe the same instant.
	mode, err := relaymode.ReadMode(ctx, tx)
	if err != nil {
		return Snapshot{}, fmt.Errorf("status: %w", err)
	}
	s.Mode, s.ModeChangedAt, s.ModeChangedBy = string(mode.Mode), mode.ChangedAt, mode.ChangedBy
	if err := readGroups(ctx, tx, opts, &s); err != nil {
		return Snapshot{}, err
	}
	if err := readFailureCodes(ctx, tx, opts, &s); err != nil {
		return Snapshot{}, err
	}
	if err := readStuck(ctx, tx, opts, &s); err != nil {
		return Snapshot{}, err
	}
	if err := readBreakers(ctx, tx, &s); err != nil {
		return Snapshot{}, err
	}
	if err := readRelays(ctx, tx, &s); err != nil {
		return Snapshot{}, err
	}
	if err := readLanes(ctx, tx, &s); err != nil {
		return Snapshot{}, err
	}
	if err := readSlots(ctx, tx, &s); err != nil {
		return Snapshot{}, err
	}
	s.Warnings = warnings(s)
	return s, tx.Commit()
}

func readGroups(ctx context.Context, tx *sql.Tx, opts Options, s *Snapshot) error {
	rows, err := tx.QueryContext(ctx, backlogQuery, opts.MaxGroups+1)
	if err != nil {
		return fmt.Errorf("status: backlog: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var g Group
		var st string
		if err := rows.Scan(&st, &g.Destination, &g.Tenant, &g.Count, &g.Oldest); err != nil {
			return fmt.Errorf("status: backlog: %w", err)
		}
		g.Status = envelope.Status(st)
		if len(s.Groups) == opts.MaxGroups {
			s.Truncated = true
			break
		}
		s.Groups = append(s.Groups, g)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("status: backlog: %w", err)
	}
	byStatus, byDest, byTenant := map[string]int64{}, map[string]int64{}, map[string]int64{}
	for _, g := range s.Groups {
		s.Unpublished += g.Count
		byStatus[string(g.Status)] += g.Count
		byDest[g.Destination] += g.Count
		byTenant[g.Tenant] += g.Count
		switch g.Status {
		case envelope.StatusPending, envelope.StatusInFlight, envelope.StatusAmbiguous:
			s.Pending += g.Count
			if s.OldestPendingAt.IsZero() || g.Oldest.Before(s.OldestPendingAt) {
				s.OldestPendingAt = g.Oldest
			}
		}
		switch g.Status {
		case envelope.StatusAmbiguous:
			s.Ambiguous += g.Count
		case envelope.StatusFailed:
			s.Failed += g.Count
		case envelope.StatusExhausted:
			s.Exhausted += g.Count
		}
	}
	if !s.OldestPendingAt.IsZero() {
		s.OldestPendingAgeSeconds = max(0, s.At.Sub(s.OldestPendingAt).Seconds())
	}
	s.ByStatus, s.ByDestination, s.ByTenant = sortedCounts(byStatus), sortedCounts(byDest), sortedCounts(byTenant)
	return nil
}

// sortedCounts orders by count, largest first, then by key, so the output is
// stable between runs.
func sortedCounts(m map[string]int64) []Count {
	out := make([]Count, 0, len(m))
	for k, v := range m {
		out = append(out, Count{Key: k, Count: v})
	}
	slices.SortFunc(out, func(a, b Count) int {
		return cmp.Or(cmp.Compare(b.Count, a.Count), cmp.Compare(a.Key, b.Key))
	})
	return out
}

func readFailureCodes(ctx context.Context, tx *sql.Tx, opts Options, s *Snapshot) error {
	rows, err := tx.QueryContext(ctx, failureCodesQuery, opts.MaxFailureCodes)
	if err != nil {
		return fmt.Errorf("status: failure codes: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var f FailureCode
		var st string
		if err := rows.Scan(&st, &f.Code, &f.Count); err != nil {
			return fmt.Errorf("status: failure codes: %w", err)
		}
		f.Status = envelope.Status(st)
		s.FailureCodes = append(s.FailureCodes, f)
	}
	return rows.Err()
}

func readStuck(ctx context.Context, tx *sql.Tx, opts Options, s *Snapshot) error {
	rows, err := tx.QueryContext(ctx, stuckCorrelationsQuery, s.At, opts.StuckAfter.Seconds(), opts.MaxStuck)
	if err != nil {
		return fmt.Errorf("status: stuck correlations: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var c StuckCorrelation
		if err := rows.Scan(&c.CorrelationID, &c.Parked, &c.LongPending, &c.Oldest, &s.StuckTotal); err != nil {
			return fmt.Errorf("status: stuck correlations: %w", err)
		}
		s.StuckCorrelations = append(s.StuckCorrelations, c)
	}
	return rows.Err()
}

func readRelays(ctx context.Context, tx *sql.Tx, s *Snapshot) error {
	live, err := relaymode.LiveRelays(ctx, tx, s.At)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	var budget int // the last non-zero budget seen
	for _, h := range live {
		s.Relays = append(s.Relays, Relay{Owner: h.Owner, StartedAt: h.StartedAt, HeartbeatAt: h.HeartbeatAt, ExpiresAt: h.ExpiresAt, MaxAttempts: h.MaxAttempts})
		if h.MaxAttempts != 0 {
			if budget != 0 && budget != h.MaxAttempts {
				s.BudgetsDiffer = true
			}
			budget = h.MaxAttempts
		}
	}
	cdc, err := relaymode.LiveCDCConsumers(ctx, tx, s.At)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	for _, h := range cdc {
		s.CDCConsumers = append(s.CDCConsumers, Relay{Owner: h.Owner, StartedAt: h.StartedAt, HeartbeatAt: h.HeartbeatAt, ExpiresAt: h.ExpiresAt, SlotName: h.SlotName})
	}
	return nil
}

// ReadSlots reads the logical replication slots of db's database with their
// lag (see [Slot]); the collector and `outboxctl status` use it.
func ReadSlots(ctx context.Context, q relaymode.Querier) ([]Slot, error) {
	rows, err := q.QueryContext(ctx, slotsQuery)
	if err != nil {
		return nil, fmt.Errorf("status: replication slots: %w", err)
	}
	defer rows.Close()
	var out []Slot
	for rows.Next() {
		var sl Slot
		var safe sql.NullInt64
		if err := rows.Scan(&sl.Name, &sl.Plugin, &sl.Active, &sl.WALStatus, &sl.RetainedWALBytes, &sl.ConfirmedLagBytes, &safe); err != nil {
			return nil, fmt.Errorf("status: replication slots: %w", err)
		}
		if safe.Valid {
			v := safe.Int64
			sl.SafeWALSizeBytes = &v
		}
		out = append(out, sl)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("status: replication slots: %w", err)
	}
	return out, nil
}

// CheckOneCDCConsumer is a readiness check for CDC mode: it returns
// CDC_SECOND_CONSUMER (relaymode.ErrSecondCDCConsumer) when the live CDC
// consumers stream from more than one slot, naming them: each slot delivers
// every insert. A native relay on a second slot is refused at start; a
// Debezium connector cannot be, so this check (and `outboxctl status`, and
// the outbox_cdc_consumer_slots gauge) is how it is reported.
func CheckOneCDCConsumer(ctx context.Context, q relaymode.Querier) error {
	live, err := relaymode.LiveCDCConsumers(ctx, q, time.Time{})
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	slots := map[string][]string{}
	var order []string
	for _, h := range live {
		if _, ok := slots[h.SlotName]; !ok {
			order = append(order, h.SlotName)
		}
		slots[h.SlotName] = append(slots[h.SlotName], h.Owner)
	}
	if len(order) < 2 {
		return nil
	}
	parts := make([]string, len(order))
	for i, sl := range order {
		parts[i] = fmt.Sprintf("slot %s (%s)", sl, strings.Join(slots[sl], ", "))
	}
	return outbox.Errorf(relaymode.CodeSecondCDCConsumer, "status.CheckOneCDCConsumer", "CDC consumers are live on %d slots: %s; every insert is delivered once per slot: stop all but one", len(order), strings.Join(parts, "; "))
}

func readSlots(ctx context.Context, tx *sql.Tx, s *Snapshot) error {
	slots, err := ReadSlots(ctx, tx)
	if err != nil {
		return err
	}
	s.Slots = slots
	rows, err := tx.QueryContext(ctx, undeliveredBeforeSlotQuery)
	if err != nil {
		return fmt.Errorf("status: slot boundaries: %w", err)
	}
	defer rows.Close()
	older := map[string]int64{}
	for rows.Next() {
		var name string
		var n int64
		if err := rows.Scan(&name, &n); err != nil {
			return fmt.Errorf("status: slot boundaries: %w", err)
		}
		older[name] = n
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("status: slot boundaries: %w", err)
	}
	for i := range s.Slots {
		if n, ok := older[s.Slots[i].Name]; ok {
			s.Slots[i].UndeliveredBeforeSlot = &n
		}
	}
	return nil
}

func warnings(s Snapshot) []string {
	var w []string
	slots := map[string]bool{}
	for _, c := range s.CDCConsumers {
		slots[c.SlotName] = true
	}
	if len(slots) > 1 {
		w = append(w, fmt.Sprintf("%d CDC consumers stream from %d different slots: each slot delivers every insert, so every message is delivered more than once; stop all but one", len(s.CDCConsumers), len(slots)))
	}
	if len(s.CDCConsumers) > 0 && s.Mode != string(relaymode.ModeCDC) {
		w = append(w, fmt.Sprintf("%d CDC consumer(s) are live while the relay mode is %s", len(s.CDCConsumers), s.Mode))
	}
	for _, sl := range s.Slots {
		switch sl.WALStatus {
		case "lost":
			w = append(w, fmt.Sprintf("slot %s is lost (invalidated): the rows in the WAL it lost were never streamed; see the README, \"A lost slot\"", sl.Name))
		case "unreserved":
			w = append(w, fmt.Sprintf("slot %s is unreserved: the next checkpoint may invalidate it", sl.Name))
		}
	}
	return w
}

// Message reads one outbox row by message id, every column included. An
// empty id is refused with OUTBOX_MESSAGE_ID_REQUIRED; an unknown id returns
// STATUS_MESSAGE_NOT_FOUND, and so does, without a query, an id no row can
// have (a NUL byte or invalid UTF-8, which PostgreSQL text cannot store). A row the envelope cannot decode is returned with
// its OUTBOX_CORRUPT_ROW error, identity fields filled, so an operator can
// still see it.
func Message(ctx context.Context, db *sql.DB, messageID string) (envelope.Row, error) {
	if messageID == "" {
		return envelope.Row{}, outbox.Errorf(outbox.CodeMessageIDRequired, "status.Message", "give the message id to inspect")
	}
	if why := pgtext.Unstorable(messageID); why != "" {
		// The server would refuse the parameter (22021) with no code.
		return envelope.Row{}, outbox.Errorf(CodeMessageNotFound, "status.Message", "no outbox row can have message_id %q: it %s", messageID, why)
	}
	row, err := envelope.ScanRow(db.QueryRowContext(ctx, messageQuery, messageID))
	if errors.Is(err, sql.ErrNoRows) {
		return envelope.Row{}, outbox.Errorf(CodeMessageNotFound, "status.Message", "no outbox row has message_id %q (it may have been published and removed by retention)", messageID)
	}
	return row, err
}

// readBreakers reads the open breakers of relays whose heartbeat is live.
func readBreakers(ctx context.Context, tx *sql.Tx, s *Snapshot) error {
	rows, err := tx.QueryContext(ctx, `SELECT b.owner, b.destination, b.opened_at, coalesce(b.last_error, '')
  FROM messaging_relay_breaker b
  JOIN messaging_relay_heartbeat h ON h.owner = b.owner AND h.expires_at > $1
 ORDER BY b.destination, b.owner
 LIMIT 1000`, s.At)
	if err != nil {
		return fmt.Errorf("status: open breakers: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var b Breaker
		if err := rows.Scan(&b.Owner, &b.Destination, &b.OpenedAt, &b.LastError); err != nil {
			return fmt.Errorf("status: open breakers: %w", err)
		}
		s.Breakers = append(s.Breakers, b)
	}
	return rows.Err()
}
