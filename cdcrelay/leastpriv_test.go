package cdcrelay_test

import (
	"context"
	"database/sql"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
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
	await.Until(t, func() bool { return len(out.ids()) == 1 }, "the row is delivered")
	require.NoError(t, wait(), "the relay under its login")
	_ = ctx
}

// securityLogin creates a login holding exactly docs/SECURITY.md's block
// (its role outbox_<role> and schema outbox renamed to this test's) and
// returns a pool connected as it and its URL (search_path on the schema).
func securityLogin(t *testing.T, e *env, base, block, role string) (*sql.DB, string) {
	t.Helper()
	doc, err := os.ReadFile("../docs/SECURITY.md")
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)<!-- grants: " + block + " -->\\s*```sql\\n(.*?)```").FindSubmatch(doc)
	require.NotNil(t, m, "docs/SECURITY.md has no %s grants block", block)
	name := "outbox_lp_" + block + "_" + e.slot[len("slot_"):]
	_, err = e.s.DB.Exec("CREATE ROLE " + name + " LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = e.s.DB.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, name)
		_, _ = e.s.DB.Exec("DROP OWNED BY " + name)
		_, _ = e.s.DB.Exec("DROP ROLE IF EXISTS " + name)
	})
	grants := regexp.MustCompile(`\b`+role+`\b`).ReplaceAllString(string(m[1]), name)
	grants = strings.ReplaceAll(grants, "SCHEMA outbox ", "SCHEMA "+e.s.Name+" ")
	for _, g := range strings.Split(grants, ";") {
		if strings.TrimSpace(g) != "" {
			_, err := e.s.DB.Exec(g)
			require.NoError(t, err, g)
		}
	}
	u, err := testdb.RoleURL(testdb.WithSearchPath(base, e.s.Name), name)
	require.NoError(t, err)
	db, err := testdb.OpenURL(u)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db, u
}

// docs/SECURITY.md's cdchandover block: HandOverToPolling, after a consumer
// that marks nothing (a Debezium connector) stopped, runs under a login
// holding exactly those grants: it delivers what the slot still holds,
// holds inserts (LOCK TABLE messaging_outbox IN SHARE MODE), marks the
// consumer's rows PUBLISHED and switches the mode to POLLING.
func TestHandOverRunsWithTheGrantsOfSecurityMD(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	ctx := context.Background()
	pub := "pub_" + e.slot
	stmt, err := debezium.PublicationSQL(debezium.Options{Schema: e.s.Name, PublicationName: pub})
	require.NoError(t, err)
	_, err = e.s.DB.Exec(stmt)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = e.s.DB.Exec("DROP PUBLICATION IF EXISTS " + pub) })

	// The slot and its boundary, as the native relay's Prepare leaves them
	// for a connector (under the cdcrelay login); then CDC mode, and rows
	// the connector never confirmed.
	cdcDB, cdcURL := securityLogin(t, e, base, "cdcrelay", "outbox_cdc")
	pcfg := e.config()
	pcfg.DB, pcfg.ConnString, pcfg.CreatePublication = cdcDB, testdb.ReplicationURL(cdcURL), false
	db, u := securityLogin(t, e, base, "cdchandover", "outbox_cdc_handover")
	cfg := e.config()
	cfg.DB, cfg.ConnString, cfg.CreatePublication = db, testdb.ReplicationURL(u), false

	prep, err := cdcrelay.New(pcfg, &recorder{}, nil)
	require.NoError(t, err)
	require.NoError(t, prep.Prepare(ctx))
	require.NoError(t, prep.Close())
	e.enableCDC(t)
	e.publish(t, "orders", msg("ho-1", "x", nil), msg("ho-2", "y", nil))

	out := &recorder{}
	handover, err := cdcrelay.New(cfg, out, nil)
	require.NoError(t, err)
	defer handover.Close()
	require.NoError(t, handover.HandOverToPolling(ctx, "lp-ops"), "the handover under its documented grants")
	mode, err := relaymode.CurrentMode(ctx, e.s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, mode)
	require.ElementsMatch(t, []string{"ho-1", "ho-2"}, out.ids(), "the handover delivered what the slot held")
	require.Equal(t, 0, testdb.QueryInt(t, e.s.DB, `SELECT count(*) FROM messaging_outbox WHERE status <> 'PUBLISHED'`))
}
