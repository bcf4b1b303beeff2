package testdb_test

import (
	"database/sql"
	"testing"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Every connection to a test schema, on either driver, commits without
// waiting for the WAL flush (synchronous_commit=off, see testdb.New), and
// its pools keep their connections idle instead of closing all but two.
func TestSchemaPoolsCommitWithoutFlushWaitAndKeepTheirConnections(t *testing.T) {
	s := testdb.New(t)
	for what, db := range map[string]*sql.DB{"New's pool": s.DB, "Open's pool": s.Open(t)} {
		var v string
		if err := db.QueryRow(`SHOW synchronous_commit`).Scan(&v); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if v != "off" {
			t.Fatalf("%s: synchronous_commit = %q, want off", what, v)
		}
		var txs []*sql.Tx
		for range 4 {
			tx, err := db.Begin()
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			txs = append(txs, tx)
		}
		for _, tx := range txs {
			if err := tx.Rollback(); err != nil {
				t.Fatalf("%s: %v", what, err)
			}
		}
		if idle := db.Stats().Idle; idle != 4 {
			t.Fatalf("%s: %d idle connections after 4 at once, want 4 (database/sql's default keeps 2)", what, idle)
		}
	}
}
