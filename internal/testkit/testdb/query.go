package testdb

import (
	"database/sql"
	"strings"
	"testing"
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
