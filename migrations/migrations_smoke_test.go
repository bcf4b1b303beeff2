package migrations_test

import (
	"testing"

	"github.com/fencedoutbox/watermill-outbox/internal/testdb"
)

func TestUpCreatesTablesInTheSchemaOfSearchPath(t *testing.T) {
	s := testdb.New(t)
	var schema string
	err := s.DB.QueryRow(`SELECT table_schema FROM information_schema.tables WHERE table_name = 'messaging_outbox' AND table_schema = $1`, s.Name).Scan(&schema)
	if err != nil {
		t.Fatalf("messaging_outbox not in %s: %v", s.Name, err)
	}
	var cols int
	if err := s.DB.QueryRow(`SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'messaging_outbox'`, s.Name).Scan(&cols); err != nil {
		t.Fatal(err)
	}
	// 34 contract columns + routing_key + created_at_utc (00020, the CDC
	// event timestamp: see that migration).
	if cols != 36 {
		t.Fatalf("messaging_outbox has %d columns, want 34 + routing_key + created_at_utc", cols)
	}
}
