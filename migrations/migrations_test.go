package migrations_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"io/fs"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// freshSchema creates an empty (unmigrated) schema, named like testdb's so a
// crashed run's leftovers are dropped by the next testdb.New, and returns its
// name and a connection string selecting it through search_path.
func freshSchema(t *testing.T) (string, string) {
	t.Helper()
	admin, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	b := make([]byte, 4)
	_, err = rand.Read(b)
	require.NoError(t, err)
	name := "outbox_test_" + strconv.FormatInt(time.Now().Unix(), 10) + "_" + hex.EncodeToString(b)
	_, err = admin.Exec(`CREATE SCHEMA ` + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(`DROP SCHEMA IF EXISTS ` + name + ` CASCADE`) })
	return name, testdb.WithSearchPath(testdb.URL(), name)
}

func open(t *testing.T, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("postgres", dsn)
	require.NoError(t, err)
	db.SetMaxOpenConns(3)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func embeddedVersions(t *testing.T) []int64 {
	t.Helper()
	entries, err := fs.Glob(migrations.FS(), "*.sql")
	require.NoError(t, err)
	var out []int64
	for _, e := range entries {
		v, _, ok := strings.Cut(e, "_")
		require.True(t, ok, e)
		n, err := strconv.ParseInt(v, 10, 64)
		require.NoError(t, err, e)
		out = append(out, n)
	}
	return out
}

func TestUpCreatesTablesInTheSchemaOfSearchPath(t *testing.T) {
	s := testdb.New(t)
	require.NotEqual(t, "public", s.Name)
	for _, table := range []string{"messaging_outbox", "messaging_admin_operation", "messaging_inbox", migrations.VersionTable} {
		var schema string
		err := s.DB.QueryRow(`SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE c.relname = $1 AND n.nspname = current_schema()`, table).Scan(&schema)
		require.NoError(t, err, "%s is not in the search_path schema", table)
		require.Equal(t, s.Name, schema, table)
	}
	// The 34 contracted columns and routing_key (later migrations may add more).
	contract := []string{"message_id", "destination", "payload", "headers", "status", "seq", "created_at",
		"occurred_at", "published_at", "attempts", "next_attempt_at", "lease_owner", "lease_token",
		"lease_expires_at", "last_failure_code", "last_failure_detail", "last_attempt_at", "producer",
		"correlation_id", "causation_id", "tenant", "partition_key", "ordering_key", "traceparent",
		"tracestate", "baggage", "schema_subject", "schema_version", "content_type", "message_type",
		"aggregate_type", "aggregate_id", "aggregate_version", "parked_at", "routing_key"}
	require.Len(t, contract, 35)
	rows, err := s.DB.Query(`SELECT column_name FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'messaging_outbox'`, s.Name)
	require.NoError(t, err)
	var cols []string
	for rows.Next() {
		var c string
		require.NoError(t, rows.Scan(&c))
		cols = append(cols, c)
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	require.Subset(t, cols, contract)
	var generated string
	require.NoError(t, s.DB.QueryRow(`SELECT is_generated FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'messaging_outbox' AND column_name = 'routing_key'`, s.Name).Scan(&generated))
	require.Equal(t, "ALWAYS", generated)

	// BENCHMARKS.md states the row's column count; it must be this schema's.
	bench, err := os.ReadFile("../BENCHMARKS.md")
	require.NoError(t, err)
	m := regexp.MustCompile(`Our row has (\d+) columns`).FindSubmatch(bench)
	require.NotNil(t, m, "BENCHMARKS.md no longer states the row's column count")
	require.Equal(t, string(m[1]), strconv.Itoa(len(cols)), "BENCHMARKS.md's column count")
}

func TestSecondUpAppliesNothing(t *testing.T) {
	s := testdb.New(t) // already migrated once
	res, err := migrations.Up(context.Background(), s.DB)
	require.NoError(t, err)
	require.Empty(t, res.Applied)
	versions := embeddedVersions(t)
	require.Equal(t, versions[len(versions)-1], res.Current)
}

func TestConcurrentUpBothSucceedAndApplyEachVersionOnce(t *testing.T) {
	name, dsn := freshSchema(t)
	a, b := open(t, dsn), open(t, dsn)
	var wg sync.WaitGroup
	results := make([]migrations.Result, 2)
	errs := make([]error, 2)
	for i, db := range []*sql.DB{a, b} {
		wg.Add(1)
		go func() { defer wg.Done(); results[i], errs[i] = migrations.Up(context.Background(), db) }()
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	versions := embeddedVersions(t)
	applied := append(append([]int64{}, results[0].Applied...), results[1].Applied...)
	require.ElementsMatch(t, versions, applied, "every version applied exactly once across both callers")
	require.Equal(t, results[0].Current, results[1].Current)
	var recorded int
	require.NoError(t, a.QueryRow(`SELECT count(*) FROM `+migrations.VersionTable+` WHERE version_id > 0`).Scan(&recorded))
	require.Equal(t, len(versions), recorded)
	var where string
	require.NoError(t, a.QueryRow(`SELECT table_schema FROM information_schema.tables WHERE table_name = 'messaging_outbox' AND table_schema = $1`, name).Scan(&where))
	require.Equal(t, name, where)
}

// TestUpWaitsForTheAdvisoryLock holds the migration lock from another
// session and shows Up trying it, applying nothing meanwhile, then finishing
// once the lock is released.
func TestUpWaitsForTheAdvisoryLock(t *testing.T) {
	name, dsn := freshSchema(t)
	ctx := context.Background()
	admin := open(t, testdb.URL())
	holder, err := admin.Conn(ctx)
	require.NoError(t, err)
	defer holder.Close()
	_, err = holder.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, migrations.SchemaLockID(name))
	require.NoError(t, err)
	released := false
	unlock := func() {
		if !released {
			released = true
			_, err := holder.ExecContext(ctx, `SELECT pg_advisory_unlock($1)`, migrations.SchemaLockID(name))
			require.NoError(t, err)
		}
	}
	defer unlock()

	app := "h1_migrate_" + name
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	db := open(t, u.String())

	done := make(chan error, 1)
	go func() {
		_, err := migrations.Up(ctx, db)
		done <- err
	}()
	await.Until(t, func() bool {
		var n int
		_ = admin.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE '%pg_try_advisory_lock%'`, app).Scan(&n)
		return n > 0
	}, "Up never tried the lock")
	var tables int
	// goose creates its version table before taking the lock (HasPending
	// runs unlocked); no migration runs until the lock is free.
	require.NoError(t, admin.QueryRow(`SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name <> $2`, name, migrations.VersionTable).Scan(&tables))
	require.Zero(t, tables, "nothing is applied while another session holds the lock")
	select {
	case err := <-done:
		t.Fatalf("Up finished while the lock was held: %v", err)
	default:
	}

	unlock()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Up did not finish after the lock was released")
	}
	var outbox int
	require.NoError(t, admin.QueryRow(`SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'messaging_outbox'`, name).Scan(&outbox))
	require.Equal(t, 1, outbox)
}

func TestEmbeddedFilesAreGooseAnnotated(t *testing.T) {
	entries, err := fs.Glob(migrations.FS(), "*.sql")
	require.NoError(t, err)
	require.NotEmpty(t, entries)
	for _, e := range entries {
		b, err := fs.ReadFile(migrations.FS(), e)
		require.NoError(t, err)
		up := strings.Index(string(b), "-- +goose Up")
		down := strings.Index(string(b), "-- +goose Down")
		require.True(t, up >= 0 && down > up, "%s needs an Up section before its Down section", e)
	}
}
