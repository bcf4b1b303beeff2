package console

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/status"
)

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
