package status

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// Lane is one lane of the lane scheme (fencing's lanes, migration 00050):
// who owns it, at which epoch, until when, and what its owner holds in
// flight there (the rows it read and has not written an outcome for, as of
// its last claim).
type Lane struct {
	Lane      int        `json:"lane"`
	Owner     string     `json:"owner,omitempty"`
	Epoch     int64      `json:"epoch"`
	ExpiresAt *time.Time `json:"lease_expires_at,omitempty"`
	Live      bool       `json:"live"`
	InFlight  int        `json:"in_flight"`
}

// readLanes reads every lane (a small table: one row per lane) and the
// fleet's fence scheme.
func readLanes(ctx context.Context, tx *sql.Tx, s *Snapshot) error {
	if err := tx.QueryRowContext(ctx, `SELECT fence FROM messaging_relay_mode WHERE id`).Scan(&s.Fence); err != nil && err != sql.ErrNoRows {
		return fmt.Errorf("status: fence: %w", err)
	}
	rows, err := tx.QueryContext(ctx, `SELECT l.lane, coalesce(l.owner, ''), l.epoch, l.lease_expires_at,
       coalesce(l.lease_expires_at > $1::timestamptz, false), coalesce(cardinality(d.held_seqs), 0)
  FROM messaging_relay_lane l LEFT JOIN messaging_relay_lane_held d ON d.lane = l.lane AND d.epoch = l.epoch
 ORDER BY l.lane`, s.At)
	if err != nil {
		return fmt.Errorf("status: lanes: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var l Lane
		if err := rows.Scan(&l.Lane, &l.Owner, &l.Epoch, &l.ExpiresAt, &l.Live, &l.InFlight); err != nil {
			return fmt.Errorf("status: lanes: %w", err)
		}
		s.Lanes = append(s.Lanes, l)
	}
	return rows.Err()
}
