package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// WALCost is what one statement of a relay (or the publisher) writes to the
// WAL per row, from EXPLAIN (ANALYZE, WAL) on a full batch, rolled back.
// WAL volume is the best single proxy for a write's cost on the server
// (heap tuple + one entry per index it lands in, full-page images).
type WALCost struct {
	Statement     string  `json:"statement"`
	Rows          int     `json:"rows"`
	BytesPerRow   float64 `json:"wal_bytes_per_row"`
	RecordsPerRow float64 `json:"wal_records_per_row"`
	FPI           int64   `json:"wal_fpi"`
	// ExecUSPerRow is the server's execution time per row (EXPLAIN
	// ANALYZE's Execution Time / rows), in microseconds.
	ExecUSPerRow float64 `json:"exec_us_per_row"`
}

type explainJSON []struct {
	Plan struct {
		WALRecords int64 `json:"WAL Records"`
		WALFPI     int64 `json:"WAL FPI"`
		WALBytes   int64 `json:"WAL Bytes"`
	} `json:"Plan"`
	Execution float64 `json:"Execution Time"`
}

func explainWAL(ctx context.Context, tx *sql.Tx, name string, rows int, q string, args ...any) (WALCost, error) {
	var raw string
	if err := tx.QueryRowContext(ctx, "EXPLAIN (ANALYZE, WAL, FORMAT JSON) "+q, args...).Scan(&raw); err != nil {
		return WALCost{}, fmt.Errorf("explain %s: %w", name, err)
	}
	var ex explainJSON
	if err := json.Unmarshal([]byte(raw), &ex); err != nil || len(ex) == 0 {
		return WALCost{}, fmt.Errorf("explain %s: %v", name, err)
	}
	p := ex[0].Plan
	return WALCost{Statement: name, Rows: rows, BytesPerRow: float64(p.WALBytes) / float64(rows),
		RecordsPerRow: float64(p.WALRecords) / float64(rows), FPI: p.WALFPI,
		ExecUSPerRow: 1000 * ex[0].Execution / float64(rows)}, nil
}

// walCosts measures, on a schema holding a PENDING backlog, the WAL per row
// of: the publisher's insert, this forwarder's claim and its terminal
// write, and the minimal relay's claim (FOR UPDATE) and UPDATE. Everything
// runs in transactions that are rolled back. A CHECKPOINT first would make
// full-page images comparable, but needs a superuser; instead FPI are
// reported beside the bytes.
func walCosts(ctx context.Context, db *sql.DB, payload []byte) ([]WALCost, error) {
	const batch = 100
	var out []WALCost
	step := func(f func(tx *sql.Tx) (WALCost, error)) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		c, err := f(tx)
		if err != nil {
			return err
		}
		out = append(out, c)
		return nil
	}
	err := step(func(tx *sql.Tx) (WALCost, error) {
		st, err := publisher.BuildInsert(benchTopic, newMessages(batch, payload), publisher.Config{})
		if err != nil {
			return WALCost{}, err
		}
		return explainWAL(ctx, tx, "publisher insert", batch, st.SQL, st.Args...)
	})
	if err == nil {
		err = step(func(tx *sql.Tx) (WALCost, error) {
			q, args, err := capture(func(db fencing.DBTX) error {
				_, err := fencing.Claim(ctx, db, probeParams())
				return err
			})
			if err != nil {
				return WALCost{}, err
			}
			return explainWAL(ctx, tx, "outbox claim (PENDING->IN_FLIGHT)", batch, q, args...)
		})
	}
	if err == nil {
		err = step(func(tx *sql.Tx) (WALCost, error) {
			got, err := fencing.Claim(ctx, tx, probeParams())
			if err != nil {
				return WALCost{}, err
			}
			// One row AMBIGUOUS: Apply sends an all-PUBLISHED batch as the
			// shorter ApplyPublishedSQL (next row of the table), any other
			// batch as ApplySQL.
			outcomes := publishedOutcomes(got)
			outcomes[len(outcomes)-1].To = envelope.StatusAmbiguous
			outcomes[len(outcomes)-1].RetryAfter = time.Second
			q, args, err := capture(func(db fencing.DBTX) error {
				_, err := fencing.Apply(ctx, db, outcomes)
				return err
			})
			if err != nil {
				return WALCost{}, err
			}
			return explainWAL(ctx, tx, "outbox terminal write (IN_FLIGHT->PUBLISHED, one AMBIGUOUS: ApplySQL)", len(got), q, args...)
		})
	}
	if err == nil {
		err = step(func(tx *sql.Tx) (WALCost, error) {
			got, err := fencing.Claim(ctx, tx, probeParams())
			if err != nil {
				return WALCost{}, err
			}
			q, args, err := capture(func(db fencing.DBTX) error {
				_, err := fencing.Apply(ctx, db, publishedOutcomes(got))
				return err
			})
			if err != nil {
				return WALCost{}, err
			}
			return explainWAL(ctx, tx, "outbox terminal write, all PUBLISHED (ApplyPublishedSQL)", len(got), q, args...)
		})
	}
	if err == nil {
		err = step(func(tx *sql.Tx) (WALCost, error) {
			return explainWAL(ctx, tx, "minimal claim (SELECT FOR UPDATE SKIP LOCKED)", batch, minimalClaim, batch)
		})
	}
	if err == nil {
		err = step(func(tx *sql.Tx) (WALCost, error) {
			rows, err := tx.QueryContext(ctx, minimalClaim, batch)
			if err != nil {
				return WALCost{}, err
			}
			var ids []string
			for rows.Next() {
				var id, dest string
				var p []byte
				if err := rows.Scan(&id, &dest, &p); err != nil {
					_ = rows.Close()
					return WALCost{}, err
				}
				ids = append(ids, id)
			}
			if err := rows.Err(); err != nil {
				return WALCost{}, err
			}
			return explainWAL(ctx, tx, "minimal UPDATE (PENDING->PUBLISHED)", len(ids), minimalDone, pq.Array(ids))
		})
	}
	return out, err
}

// publishedOutcomes is a PUBLISHED outcome for each claimed row, as the
// forwarder writes them after a batch that all went out.
func publishedOutcomes(claimed []fencing.Claimed) []fencing.Outcome {
	out := make([]fencing.Outcome, len(claimed))
	for i, c := range claimed {
		out[i] = fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished}
	}
	return out
}

// errCaptured ends a call made on a capturing DBTX.
var errCaptured = errors.New("statement captured, not run")

// capturing is a fencing.DBTX that runs nothing and keeps the statement and
// arguments of the call made on it, so EXPLAIN measures exactly what fencing
// sends (a parameter fencing reorders cannot silently change what is
// measured).
type capturing struct {
	query string
	args  []any
}

func (c *capturing) ExecContext(_ context.Context, q string, args ...any) (sql.Result, error) {
	c.query, c.args = q, args
	return nil, errCaptured
}

func (c *capturing) QueryContext(_ context.Context, q string, args ...any) (*sql.Rows, error) {
	c.query, c.args = q, args
	return nil, errCaptured
}

// QueryRowContext cannot carry an error out of a *sql.Row built here; the
// calls captured (Claim, Apply) do not use it.
func (c *capturing) QueryRowContext(context.Context, string, ...any) *sql.Row {
	panic("outbox-bench: capture of a QueryRowContext call")
}

// capture runs call on a capturing DBTX and returns the one statement it sent.
func capture(call func(fencing.DBTX) error) (string, []any, error) {
	c := &capturing{}
	if err := call(c); !errors.Is(err, errCaptured) {
		return "", nil, fmt.Errorf("capture: the call did not send a statement (err %v)", err)
	}
	return c.query, c.args, nil
}
