package testdb_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The driver matrix is real: the pools testdb opens use the driver
// OUTBOX_TEST_DRIVER names (lib/pq's *pq.Driver or pgx's *stdlib.Driver).
func TestPoolsUseTheDriverAskedFor(t *testing.T) {
	s := testdb.New(t)
	got := fmt.Sprintf("%T", s.DB.Driver())
	want := map[string]string{"postgres": "*pq.Driver", "pgx": "*stdlib.Driver"}[testdb.Driver()]
	if want == "" {
		t.Fatalf("unknown %s=%q", testdb.DriverEnv, testdb.Driver())
	}
	if got != want {
		t.Fatalf("pools use %s, want %s", got, want)
	}
	if !strings.Contains(s.URL, s.Name) {
		t.Fatalf("the schema URL %q does not select %s", s.URL, s.Name)
	}
}
