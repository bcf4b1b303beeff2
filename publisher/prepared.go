package publisher

import (
	"context"
	"database/sql"
	"fmt"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/stmtset"
)

// Prepared holds the publisher's INSERT statements prepared on one *sql.DB.
// Set it as Config.Prepared and every Publisher built with that Config runs
// its INSERT as a prepared statement of the transaction's connection:
// PostgreSQL does not parse and plan the statement again on every Publish,
// and lib/pq sends it in one round trip instead of two. Build it once at
// start-up, after the migrations, and share it:
//
//	prep, err := publisher.Prepare(ctx, db)
//	...
//	defer prep.Close()
//	cfg := publisher.Config{Producer: "billing", Prepared: prep}
//
// Only transactions of that same *sql.DB can use it (anything else is
// refused with OUTBOX_INVALID_CONFIG). database/sql prepares each statement
// again, inside the transaction, on a pooled connection that has not
// prepared it yet (for example after a reconnect), so no Publish ever waits
// for a second connection. Connection poolers in transaction mode that do
// not track prepared statements (PgBouncer before 1.21) cannot carry them:
// leave Config.Prepared nil there.
type Prepared struct {
	stmts stmtset.Set
}

// Prepare prepares every statement a Publisher can send (three column sets,
// one or many rows, with and without NOTIFY) on db. It fails when
// messaging_outbox is not there yet: run the migrations first.
func Prepare(ctx context.Context, db *sql.DB) (*Prepared, error) {
	const op = "publisher.Prepare"
	if db == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, "db is nil")
	}
	p := &Prepared{}
	shapes := make([][2][2]string, 0, len(statements)+1)
	for _, byShape := range statements {
		shapes = append(shapes, byShape)
	}
	for _, byShape := range append(shapes, lockedStatements) {
		for _, byNotify := range byShape {
			for _, q := range byNotify {
				if _, _, err := p.stmts.GetOrPrepare(q, func() (*sql.Stmt, error) { return db.PrepareContext(ctx, q) }); err != nil {
					_ = p.Close()
					return nil, fmt.Errorf("%s: %w", op, err)
				}
			}
		}
	}
	return p, nil
}

// stmt is the prepared form of query for tx's connection. Prepared never
// goes to the pool for it: tx.StmtContext reuses the statement already
// prepared on tx's connection, or prepares it there.
func (p *Prepared) stmt(ctx context.Context, tx *sql.Tx, query string) (*sql.Stmt, error) {
	st, closed := p.stmts.Get(query)
	if closed {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "publisher.Publish",
			"Config.Prepared was closed; prepare again or leave it nil")
	}
	if st == nil {
		// Every statement the publisher builds is prepared by Prepare; a
		// miss is a bug here, not a caller's error.
		return nil, fmt.Errorf("publisher: statement not prepared: %q", query)
	}
	return tx.StmtContext(ctx, st), nil
}

// Close releases the statements on every connection that prepared them.
// Publishers using it are refused afterwards (OUTBOX_INVALID_CONFIG).
// Safe to call more than once.
func (p *Prepared) Close() error { return p.stmts.Close() }
