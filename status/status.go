package status

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
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
			w = append(w, fmt.Sprintf("slot %s is lost (invalidated): the rows in the WAL it lost were never streamed; see docs/CDC.md, \"A lost slot\"", sl.Name))
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
