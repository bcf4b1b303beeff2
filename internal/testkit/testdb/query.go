package testdb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"
)

// QueryInt returns the one integer q selects on db (usually a count(*)).
// q is trusted test SQL; args are bound.
func QueryInt(t testing.TB, db *sql.DB, q string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(q, args...).Scan(&n); err != nil {
		t.Fatalf("testdb: %s: %v", q, err)
	}
	return n
}

// Explain returns the plan PostgreSQL chooses for q with args bound, one
// plan line per text line, for tests that pin a statement to an index. Plain
// EXPLAIN does not run q; it is still issued inside a transaction that is
// rolled back, so a data-modifying q can never leave a trace.
func Explain(t testing.TB, db *sql.DB, q string, args ...any) string {
	t.Helper()
	tx, err := db.Begin()
	if err != nil {
		t.Fatalf("testdb: explain: begin: %v", err)
	}
	defer func() { _ = tx.Rollback() }()
	plan := ExplainIn(t, tx, q, args...)
	if err := tx.Rollback(); err != nil {
		t.Fatalf("testdb: explain: rollback: %v", err)
	}
	return plan
}

// ExplainIn is Explain inside the caller's transaction, for a plan under
// settings or schema changes made there first (SET LOCAL, an index dropped
// for the transaction); the caller rolls it back.
func ExplainIn(t testing.TB, tx *sql.Tx, q string, args ...any) string {
	t.Helper()
	rows, err := tx.Query("EXPLAIN "+q, args...)
	if err != nil {
		t.Fatalf("testdb: EXPLAIN %s: %v", q, err)
	}
	defer rows.Close()
	var plan strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatalf("testdb: explain: %v", err)
		}
		plan.WriteString(line + "\n")
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("testdb: explain: %v", err)
	}
	return plan.String()
}

// ExplainPrepared returns EXPLAIN (options) of q run as a prepared
// statement on conn, with args, on the plan conn's plan_cache_mode gives it:
// the generic plan under force_generic_plan, a custom one under
// force_custom_plan (anything else is refused: the test would not know which
// plan it read). A statement without arguments has only its generic plan.
// It runs in a transaction it rolls back (options may hold ANALYZE), and
// one line of the result is one line of the plan.
//
// The statement is PREPAREd in SQL and EXPLAINed through EXECUTE, with args
// as literals. EXPLAIN of q itself with the arguments bound would not do:
// PostgreSQL plans the statement an EXPLAIN wraps afresh, with the bound
// values folded in as constants, whatever plan_cache_mode says, so it
// always shows a custom plan.
func ExplainPrepared(t testing.TB, conn *sql.Conn, options, q string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	var mode string
	if err := conn.QueryRowContext(ctx, `SELECT current_setting('plan_cache_mode')`).Scan(&mode); err != nil {
		t.Fatalf("testdb: explain prepared: %v", err)
	}
	if mode != "force_generic_plan" && mode != "force_custom_plan" {
		t.Fatalf("testdb: explain prepared: set plan_cache_mode to force_generic_plan or force_custom_plan on the connection (it is %s)", mode)
	}
	// A prepared statement belongs to the session, not to a transaction:
	// it is dropped after the rollback below, on a session no longer in a
	// failed transaction.
	if _, err := conn.ExecContext(ctx, `PREPARE explain_prepared AS `+q); err != nil {
		t.Fatalf("testdb: PREPARE %s: %v", q, err)
	}
	defer func() { _, _ = conn.ExecContext(ctx, `DEALLOCATE explain_prepared`) }()
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		t.Fatalf("testdb: explain prepared: begin: %v", err)
	}
	defer func() { _ = tx.Rollback() }()
	lits := make([]string, len(args))
	for i, a := range args {
		lits[i] = literal(t, a)
	}
	explain := "EXPLAIN "
	if options != "" {
		explain += "(" + options + ") "
	}
	explain += "EXECUTE explain_prepared"
	if len(lits) > 0 {
		explain += "(" + strings.Join(lits, ", ") + ")"
	}
	rows, err := tx.QueryContext(ctx, explain)
	if err != nil {
		t.Fatalf("testdb: EXPLAIN EXECUTE %s: %v", q, err)
	}
	var plan strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatalf("testdb: explain prepared: %v", err)
		}
		plan.WriteString(line + "\n")
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		t.Fatalf("testdb: explain prepared: %v", err)
	}
	var generic, custom int
	if err := tx.QueryRowContext(ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = 'explain_prepared'`).Scan(&generic, &custom); err != nil {
		t.Fatalf("testdb: explain prepared: %v", err)
	}
	// A statement without parameters has one plan, the generic one.
	if wantGeneric := mode == "force_generic_plan" || len(args) == 0; generic+custom != 1 || (generic == 1) != wantGeneric {
		t.Fatalf("testdb: explain prepared: under %s PostgreSQL made %d generic and %d custom plans", mode, generic, custom)
	}
	return plan.String()
}

// literal is v, an argument of a statement, as an SQL literal of unknown
// type (EXECUTE casts it to the parameter's type).
func literal(t testing.TB, v any) string {
	t.Helper()
	if val, ok := v.(driver.Valuer); ok {
		var err error
		if v, err = val.Value(); err != nil {
			t.Fatalf("testdb: explain prepared: %v", err)
		}
	}
	switch x := v.(type) {
	case nil:
		return "NULL"
	case string:
		return pq.QuoteLiteral(x)
	case []byte:
		return pq.QuoteLiteral(string(x))
	case time.Time:
		return pq.QuoteLiteral(x.Format(time.RFC3339Nano))
	case int, int32, int64, float64, bool:
		return pq.QuoteLiteral(fmt.Sprint(x))
	}
	t.Fatalf("testdb: explain prepared: no SQL literal for an argument of type %T", v)
	return ""
}
