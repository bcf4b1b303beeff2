package leastpriv_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/leakcheck"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
	"github.com/fencedoutbox/watermill-outbox/retention"
	"github.com/fencedoutbox/watermill-outbox/status"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

var blockRe = regexp.MustCompile("(?s)<!-- grants: ([a-z]+) -->\\s*```sql\\n(.*?)```")

// grants reads the SQL blocks of docs/SECURITY.md by component.
func grants(t *testing.T) map[string]string {
	t.Helper()
	doc, err := os.ReadFile("../../../docs/SECURITY.md")
	require.NoError(t, err)
	out := map[string]string{}
	for _, m := range blockRe.FindAllStringSubmatch(string(doc), -1) {
		out[m[1]] = m[2]
	}
	for _, c := range []string{"migrate", "app", "relay", "reader", "approver", "operator", "cleanup", "mode"} {
		require.Contains(t, out, c, "docs/SECURITY.md has no grants block for %s", c)
	}
	return out
}

// env is a fresh empty schema and one login per component.
type env struct {
	t      *testing.T
	schema string
	admin  *sql.DB // superuser, search_path on the schema
	suffix string
}

func newEnv(t *testing.T) *env {
	e := &env{t: t, suffix: fmt.Sprintf("%d", time.Now().UnixNano()%1_000_000_000)}
	e.schema = "outbox_test_lp_" + e.suffix
	admin, err := testdb.OpenURL(testdb.URL())
	require.NoError(t, err)
	_, err = admin.Exec("CREATE SCHEMA " + e.schema)
	require.NoError(t, err)
	require.NoError(t, admin.Close())
	e.admin, err = testdb.OpenURL(testdb.WithSearchPath(testdb.URL(), e.schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.admin.Close() })
	return e
}

// login creates the component's role, runs its documented grants (schema
// outbox and role outbox_<component> renamed to this test's) and returns a
// pool connected as it, search_path on the schema. Roles are dropped after
// the schema.
func (e *env) login(component, sqlText string) (string, *sql.DB) {
	t := e.t
	t.Helper()
	role := "outbox_lp_" + component + "_" + e.suffix
	_, err := e.admin.Exec("CREATE ROLE " + role + " LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		admin, err := testdb.OpenURL(testdb.URL())
		if err != nil {
			return
		}
		defer admin.Close()
		_, _ = admin.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
		_, _ = admin.Exec("DROP SCHEMA IF EXISTS " + e.schema + " CASCADE")
		_, _ = admin.Exec("DROP OWNED BY " + role)
		_, _ = admin.Exec("DROP ROLE IF EXISTS " + role)
	})
	sqlText = strings.ReplaceAll(sqlText, "outbox_"+component, role)
	sqlText = strings.ReplaceAll(sqlText, "SCHEMA outbox ", "SCHEMA "+e.schema+" ")
	for _, stmt := range strings.Split(sqlText, ";") {
		if strings.TrimSpace(stmt) == "" {
			continue
		}
		_, err := e.admin.Exec(stmt)
		require.NoError(t, err, "grant of %s: %s", component, stmt)
	}
	u, err := testdb.RoleURL(testdb.WithSearchPath(testdb.URL(), e.schema), role)
	require.NoError(t, err)
	db, err := testdb.OpenURL(u)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return role, db
}

// insufficient reports whether err is PostgreSQL's 42501.
func insufficient(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && s.SQLState() == "42501"
}

// okOrRejects publishes everything but the message "bad", which it rejects
// for good.
type okOrRejects struct {
	mu   sync.Mutex
	sent []string
}

func (p *okOrRejects) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		if m.UUID == "bad" {
			return forwarder.Reject(errors.New("refused"), "TEST_REFUSED")
		}
		p.sent = append(p.sent, m.UUID)
	}
	return nil
}
func (p *okOrRejects) Close() error { return nil }

// docs/SECURITY.md's promise: each component works under a login holding
// only its documented grants, and the separations hold.
func TestEveryComponentRunsWithExactlyItsGrants(t *testing.T) {
	ctx := context.Background()
	g := grants(t)
	e := newEnv(t)

	// migrate: CREATE on the schema, nothing else.
	_, migrateDB := e.login("migrate", g["migrate"])
	_, err := migrations.Up(ctx, migrateDB)
	require.NoError(t, err, "migrations under the migrate login")

	_, app := e.login("app", g["app"])
	_, relay := e.login("relay", g["relay"])
	_, reader := e.login("reader", g["reader"])
	_, approver := e.login("approver", g["approver"])
	operatorRole, operator := e.login("operator", g["operator"])
	_, cleanup := e.login("cleanup", g["cleanup"])
	_, mode := e.login("mode", g["mode"])

	// app: publish (ordering key, lock, notify) and an inbox delivery.
	cfg := publisher.Config{LockOrderingKeys: true, Notify: true}
	require.NoError(t, publisher.InTx(ctx, app, cfg, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		good := message.NewMessage("good", []byte("x"))
		envelope.SetOrderingKey(good, "k")
		return pub.Publish("orders", good, message.NewMessage("bad", []byte("x")))
	}))
	h := inbox.Middleware(app, "billing", inbox.Config{})(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_, err = h(message.NewMessage("in-1", nil))
	require.NoError(t, err, "inbox delivery under the app login")

	// relay: a Run that publishes one row and parks the other, then stops.
	out := &okOrRejects{}
	done := make(chan struct{}, 10)
	f, err := forwarder.New(relay, out, nil, forwarder.Config{Owner: "lp-relay", OnReport: func(r forwarder.Report) {
		if r.Published+r.Failed > 0 {
			done <- struct{}{}
		}
	}})
	require.NoError(t, err)
	runErr := make(chan error, 1)
	go func() { runErr <- f.Run(ctx) }()
	var settled int
	for settled < 2 {
		select {
		case <-done:
			settled = testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox WHERE status IN ('PUBLISHED', 'FAILED')`)
		case err := <-runErr:
			t.Fatalf("relay stopped under its login: %v", err)
		case <-time.After(30 * time.Second):
			t.Fatal("the relay settled no row under its login in 30s")
		}
	}
	require.NoError(t, f.Close())
	require.NoError(t, <-runErr, "relay Run under its login")
	require.Equal(t, 1, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox WHERE message_id = 'bad' AND status = 'FAILED'`))
	// The relay login cannot switch the relay mode.
	_, err = relay.Exec(`UPDATE messaging_relay_mode SET mode = 'CDC'`)
	require.True(t, insufficient(err), "a relay login switched the relay mode: %v", err)

	// The mode login switches to CDC and back (no relay is alive now),
	// after the schema check every outboxctl command makes first.
	require.NoError(t, migrations.Check(ctx, mode), "the schema check under the mode login")
	require.NoError(t, relaymode.Enable(ctx, mode, "lp-test", time.Time{}), "debezium enable under the mode login")
	require.NoError(t, relaymode.Disable(ctx, mode, "lp-test"), "debezium disable under the mode login")

	// status and inspect, read only.
	_, err = status.Collect(ctx, reader)
	require.NoError(t, err, "status under the reader login")
	_, err = status.Message(ctx, reader, "bad")
	require.NoError(t, err, "inspect under the reader login")
	_, err = reader.Exec(`DELETE FROM messaging_outbox`)
	require.True(t, insufficient(err), "the reader login deleted rows: %v", err)

	// approver approves; the operator cannot approve, and executes.
	ja, err := journal.New(approver, journal.Config{})
	require.NoError(t, err)
	a, err := ja.Approve(ctx, "CHG-LP", journal.OpRedrive, journal.Filter{})
	require.NoError(t, err, "approval under the approver login")
	require.EqualValues(t, 1, a.Count)
	jo, err := journal.New(operator, journal.Config{RequireApproval: true})
	require.NoError(t, err)
	_, err = jo.Approve(ctx, "CHG-SELF", journal.OpPurge, journal.Filter{})
	require.True(t, insufficient(err), "the operator login approved its own plan: %v", err)
	res, err := jo.Redrive(ctx, "CHG-LP", journal.Filter{}, journal.Options{})
	require.NoError(t, err, "redrive under the operator login")
	require.EqualValues(t, 1, res.Items)
	rec, err := jo.Find(ctx, "CHG-LP")
	require.NoError(t, err)
	require.Equal(t, []string{operatorRole}, rec.ExecutedBy)
	_, err = e.admin.Exec(`UPDATE messaging_outbox SET status = 'EXHAUSTED', parked_at = now(), attempts = 1 WHERE message_id = 'bad'`)
	require.NoError(t, err)
	_, err = ja.Approve(ctx, "CHG-LP2", journal.OpPurge, journal.Filter{})
	require.NoError(t, err)
	res, err = jo.Purge(ctx, "CHG-LP2", journal.Filter{}, journal.Options{})
	require.NoError(t, err, "purge under the operator login")
	require.EqualValues(t, 1, res.Items)

	// cleanup, delete then archive mode, inbox included.
	future := func() time.Time { return time.Now().Add(30 * 24 * time.Hour) }
	for _, archive := range []bool{false, true} {
		c, err := retention.New(cleanup, nil, retention.Config{Archive: archive, InboxHorizon: retention.MinInboxHorizon, Now: future})
		require.NoError(t, err)
		_, err = c.Run(ctx)
		require.NoError(t, err, "retention (archive %v) under the cleanup login", archive)
		if !archive {
			require.Zero(t, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_inbox`))
			require.Zero(t, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox WHERE status = 'PUBLISHED'`))
			published := func(id string) testdb.OutboxRow {
				return testdb.Row(envelope.Row{MessageID: id, Destination: "orders", Payload: []byte("x"), Status: envelope.StatusPublished})
			}
			testdb.InsertRows(t, e.admin, published("arch"), published("conf")) // published_at: now()
			// Already archived with other content: archive mode marks it.
			_, err = e.admin.Exec(`INSERT INTO messaging_outbox_archive (` + envelope.SelectColumns + `, archived_at)
				SELECT ` + envelope.SelectColumns + `, now() FROM messaging_outbox WHERE message_id = 'conf'`)
			require.NoError(t, err)
			_, err = e.admin.Exec(`UPDATE messaging_outbox_archive SET payload = 'other' WHERE message_id = 'conf'`)
			require.NoError(t, err)
		}
	}
	require.Equal(t, 1, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox_archive WHERE message_id = 'arch'`))
	require.Equal(t, 1, testdb.QueryInt(t, e.admin, `SELECT count(*) FROM messaging_outbox WHERE message_id = 'conf' AND last_failure_code = 'RETENTION_ARCHIVE_CONFLICT'`))
	// Its UPDATE privilege (for FOR UPDATE) changes no outbox row.
	_, err = cleanup.Exec(`UPDATE messaging_outbox SET status = 'PENDING'`)
	require.True(t, insufficient(err), "the cleanup login updated a status: %v", err)
	_, err = cleanup.Exec(`UPDATE messaging_outbox SET routing_key = 'x'`)
	require.Error(t, err, "routing_key is generated: no UPDATE sets it")
}
