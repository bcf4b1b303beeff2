package cdcrelay_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// docs/SECURITY.md's cdcrelay block: the relay streams, beats and publishes
// under a login holding exactly those grants (the publication is the table
// owner's to create).
func TestRelayRunsWithTheGrantsOfSecurityMD(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	e.enableCDC(t)
	ctx := context.Background()
	pub := "pub_" + e.slot
	stmt, err := debezium.PublicationSQL(debezium.Options{Schema: e.s.Name, PublicationName: pub})
	require.NoError(t, err)
	_, err = e.s.DB.Exec(stmt)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = e.s.DB.Exec("DROP PUBLICATION IF EXISTS " + pub) })

	doc, err := os.ReadFile("../docs/SECURITY.md")
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)<!-- grants: cdcrelay -->\\s*```sql\\n(.*?)```").FindSubmatch(doc)
	require.NotNil(t, m, "docs/SECURITY.md has no cdcrelay grants block")
	role := "outbox_lp_cdc_" + e.slot[len("slot_"):]
	_, err = e.s.DB.Exec("CREATE ROLE " + role + " LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = e.s.DB.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
		_, _ = e.s.DB.Exec("DROP OWNED BY " + role)
		_, _ = e.s.DB.Exec("DROP ROLE IF EXISTS " + role)
	})
	grants := strings.ReplaceAll(string(m[1]), "outbox_cdc", role)
	grants = strings.ReplaceAll(grants, "SCHEMA outbox ", "SCHEMA "+e.s.Name+" ")
	for _, g := range strings.Split(grants, ";") {
		if strings.TrimSpace(g) != "" {
			_, err := e.s.DB.Exec(g)
			require.NoError(t, err, g)
		}
	}
	roleURL, err := testdb.RoleURL(testdb.WithSearchPath(base, e.s.Name), role)
	require.NoError(t, err)
	db, err := testdb.OpenURL(roleURL)
	require.NoError(t, err)
	defer db.Close()

	cfg := e.config()
	cfg.DB, cfg.ConnString, cfg.CreatePublication = db, testdb.ReplicationURL(roleURL), false
	out := &recorder{}
	wait := e.relay(t, cfg, out)
	e.publish(t, "orders", msg("lp-1", "x", nil))
	require.Eventually(t, func() bool { return len(out.ids()) == 1 }, 20*time.Second, 10*time.Millisecond)
	require.NoError(t, wait(), "the relay under its login")
	_ = ctx
}
