package fencing

import (
	"context"
	"database/sql"

	"github.com/fencedoutbox/watermill-outbox/internal/stmtset"
)

// Prepared is a [DBTX] that runs the claim and outcome statements of this
// package (the statements of [Claim], see [ClaimStatement], and those of
// [Apply]) as prepared statements on db, and passes every other
// statement to db unchanged. Pass it to [Claim] and [Apply] in place of db.
//
// Why: PostgreSQL parses and plans an unprepared statement on every call, and
// the claim's plan costs more than claiming 100 rows (about 0.8 ms of planning
// against 0.4–0.6 ms of execution on PostgreSQL 15). A prepared statement is
// parsed once per connection, lib/pq sends it in one round trip instead of
// two, and it receives bytea and integer columns in binary form instead of
// hex text. PostgreSQL switches a prepared statement to a cached generic
// plan after five executions when that plan is estimated no costlier than
// the custom ones. Every claim of any destination does, in both fence
// schemes (TestClaimsSwitchToTheirGenericPlans); a claim that excludes or
// requires a destination (an open breaker, a probe) runs a statement with
// destination filters, whose custom plans PostgreSQL may keep making
// (anyDestination says why). database/sql prepares each statement lazily on
// each pooled connection and again after a reconnect.
//
// Connection poolers in transaction mode that do not track prepared
// statements (PgBouncer before 1.21) cannot carry them; use the *sql.DB
// directly there (forwarder.Config.DisablePreparedStatements).
//
// Safe for concurrent use. Close releases the statements; afterwards every
// statement runs unprepared on db.
type Prepared struct {
	db    conn
	stmts stmtset.Set
}

// conn is what *sql.DB and *sql.Conn have in common: a Prepared runs on a
// pool or on one of its connections.
type conn interface {
	DBTX
	PrepareContext(ctx context.Context, query string) (*sql.Stmt, error)
}

var _ DBTX = (*Prepared)(nil)

// preparable is the set of statements Prepared prepares: the ones a relay
// runs on every pass. Everything else is rare and runs unprepared.
var preparable = map[string]bool{
	claimBlockKeySQL:      true,
	claimSkipParkedSQL:    true,
	claimUnkeyedSQL:       true,
	claimBlockKeyAnySQL:   true,
	claimSkipParkedAnySQL: true,
	claimUnkeyedAnySQL:    true,
	applySQL:              true,
	applyPublishedSQL:     true,
}

// NewPrepared returns a Prepared over db. It does not touch the database:
// each statement is prepared by its first use.
func NewPrepared(db *sql.DB) *Prepared {
	return &Prepared{db: db}
}

// NewPreparedConn returns a Prepared over one connection of a pool: its
// statements are prepared on that connection alone, by their first use.
// The caller keeps the connection to itself while it uses the Prepared (a
// connection runs one statement at a time), and closes the Prepared before
// the connection.
func NewPreparedConn(c *sql.Conn) *Prepared {
	return &Prepared{db: c}
}

// stmt returns the prepared form of query, preparing it on first use, or nil
// when query is not one Prepared prepares (or Prepared is closed). A failed
// prepare is returned and not remembered: the next call tries again.
func (p *Prepared) stmt(ctx context.Context, query string) (*sql.Stmt, error) {
	if _, lane := laneStatements.Load(query); !preparable[query] && !lane {
		return nil, nil
	}
	st, _, err := p.stmts.GetOrPrepare(query, func() (*sql.Stmt, error) { return p.db.PrepareContext(ctx, query) })
	return st, err
}

// QueryContext runs query, prepared when it is one of the package's hot
// statements.
func (p *Prepared) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	st, err := p.stmt(ctx, query)
	if err != nil {
		return nil, err
	}
	if st == nil {
		return p.db.QueryContext(ctx, query, args...)
	}
	return st.QueryContext(ctx, args...)
}

// ExecContext runs query, prepared when it is one of the package's hot
// statements.
func (p *Prepared) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	st, err := p.stmt(ctx, query)
	if err != nil {
		return nil, err
	}
	if st == nil {
		return p.db.ExecContext(ctx, query, args...)
	}
	return st.ExecContext(ctx, args...)
}

// QueryRowContext runs query, prepared when it is one of the package's hot
// statements. *sql.Row cannot carry an error from outside database/sql, so a
// statement that fails to prepare runs unprepared instead.
func (p *Prepared) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	if st, err := p.stmt(ctx, query); err == nil && st != nil {
		return st.QueryRowContext(ctx, args...)
	}
	return p.db.QueryRowContext(ctx, query, args...)
}

// Close releases the prepared statements on every connection that holds
// them. Statements still running finish first (database/sql waits for them).
// Safe to call more than once.
func (p *Prepared) Close() error { return p.stmts.Close() }
