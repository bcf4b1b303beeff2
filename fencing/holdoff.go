// The end of a destination's hold-off: the rows a relay put back without
// an attempt while the destination was unavailable, made claimable again
// once it is back.

package fencing

import (
	"context"
	"fmt"
	"time"
)

const endHoldOffSQL = `UPDATE messaging_outbox SET next_attempt_at = NULL
 WHERE destination = $1 AND published_at IS NULL AND parked_at IS NULL AND status IN ('PENDING', 'AMBIGUOUS')
   AND last_failure_code IN ($2, $3) AND next_attempt_at > coalesce($4::timestamptz, now())`

// EndHoldOff makes the rows of destination that wait out a hold-off
// claimable at once: the rows, neither published nor parked, PENDING or
// AMBIGUOUS, whose last_failure_code is one of codes (the codes a relay
// writes when it puts a row back without an attempt because the
// destination was unavailable) and whose next_attempt_at lies after now
// (zero: the database's now()) get no next_attempt_at. It touches no lease,
// attempt count or failure code. It returns how many rows it changed.
//
// A relay calls it when the destination's breaker closes: the hold-off (as
// long as the breaker had been open) only spread the probes over the
// backlog, and without it a row given back late in a long outage would
// wait out most of that outage's length again after the downstream is
// back.
func EndHoldOff(ctx context.Context, db DBTX, destination string, codes [2]string, now time.Time) (int64, error) {
	const op = "fencing.EndHoldOff"
	var at any
	if !now.IsZero() {
		at = now
	}
	res, err := db.ExecContext(ctx, endHoldOffSQL, destination, codes[0], codes[1], at)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", op, err)
	}
	return n, nil
}
