package status

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Slot is one logical replication slot of the database, as
// pg_replication_slots reports it, with its lag in bytes of WAL. A slot keeps
// WAL from its restart position on: RetainedWALBytes is what it holds (what
// the server cannot recycle), ConfirmedLagBytes how far its consumer's
// confirmed position is behind the server's WAL. WALStatus is "reserved" or
// "extended" (fine), "unreserved" (the next checkpoint may remove WAL it
// needs) or "lost" (it can no longer be streamed; see docs/CDC.md).
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
