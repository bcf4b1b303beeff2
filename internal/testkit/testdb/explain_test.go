package testdb_test

import (
	"context"
	"strings"
	"testing"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// ExplainPrepared shows the plan plan_cache_mode gives a prepared
// statement: the generic plan keeps the parameter, a custom plan has the
// argument folded in. Plain EXPLAIN with the argument bound shows the
// custom plan in either mode, which is why the helper exists.
func TestExplainPreparedShowsTheGenericOrTheCustomPlan(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	conn, err := s.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	q := `SELECT message_id FROM messaging_outbox WHERE destination = $1 AND seq > $2`
	for mode, want := range map[string]string{"force_generic_plan": "$1", "force_custom_plan": "'it''s'"} {
		if _, err := conn.ExecContext(ctx, "SET plan_cache_mode = "+mode); err != nil {
			t.Fatal(err)
		}
		plan := testdb.ExplainPrepared(t, conn, "", q, "it's", int64(7))
		if !strings.Contains(plan, "destination = "+want) {
			t.Fatalf("%s: the plan does not compare destination with %s:\n%s", mode, want, plan)
		}
		// The statement is gone: the next call prepares it again.
		if again := testdb.ExplainPrepared(t, conn, "COSTS OFF", q, "it's", int64(7)); strings.Contains(again, "cost=") {
			t.Fatalf("%s: the options were not applied:\n%s", mode, again)
		}
	}
}
