// Package testdb gives tests a real PostgreSQL: a fresh schema per call,
// migrated with the module's migrations (replayed in one statement, see
// migrate.go), dropped when the test ends.
//
// The server comes from OUTBOX_TEST_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable). With no server
// the tests fail loudly: the core suite never skips for want of a database.
//
// Outbox rows come from the row factory ([InsertRow], [InsertRows]): an
// envelope.Row of any status with any columns set, defaults for the rest,
// valid by construction against the table's CHECKs. Hand-written INSERTs are
// for rows whose point is raw SQL: bad input, constraint and migration tests.
package testdb

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	neturl "net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq" // database/sql driver "postgres"
)

// DriverEnv selects the database/sql driver of every pool testdb opens:
// "postgres" (lib/pq, the default) or "pgx" (pgx's stdlib driver). The core
// module does not require pgx (a service importing the core would see it in
// its module graph), so the pgx run links the driver in through an overlay:
// `make unit-pgx` (scripts/pgx-overlay.sh).
const DriverEnv = "OUTBOX_TEST_DRIVER"

// Driver returns the database/sql driver name the tests use.
func Driver() string {
	if v := os.Getenv(DriverEnv); v != "" {
		return v
	}
	return "postgres"
}

// OpenURL opens a pool on url with Driver(). On pgx it sets
// default_query_exec_mode=describe_exec (unless url sets a mode): pgx's
// default mode prepares and caches every statement by name on the
// connection, and the tests that check what a connection holds
// (pg_prepared_statements after Prepare) would count pgx's own cache.
// Refusals, codes and results are the same in every mode.
func OpenURL(url string) (*sql.DB, error) {
	if Driver() == "pgx" && !strings.Contains(url, "default_query_exec_mode") {
		url = withParam(url, "default_query_exec_mode", "describe_exec")
	}
	return sql.Open(Driver(), url)
}

func withParam(base, key, value string) string {
	u, err := neturl.Parse(base)
	if err != nil || u.Scheme == "" {
		return base + " " + key + "=" + value
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

// DefaultURL is used when OUTBOX_TEST_DATABASE_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

const schemaPrefix = "outbox_test_"

// URL returns the base connection string of the test server.
func URL() string {
	if v := os.Getenv("OUTBOX_TEST_DATABASE_URL"); v != "" {
		return v
	}
	return DefaultURL
}

// WithSearchPath returns base with search_path set to schema.
func WithSearchPath(base, schema string) string {
	u, err := neturl.Parse(base)
	if err != nil || u.Scheme == "" {
		return base + " search_path=" + schema
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// Schema is a migrated, isolated schema on the test server.
type Schema struct {
	Name string  // schema name
	URL  string  // connection string whose search_path selects the schema
	DB   *sql.DB // pool bound to the schema
}

// New creates a fresh schema, migrates it and returns a pool bound to it.
// The schema is dropped in t.Cleanup. Schemas left behind by crashed runs
// (older than an hour) are dropped on the way. Its URL sets
// synchronous_commit=off (see sessionURL), and its pools keep IdleConns idle
// connections.
func New(t testing.TB) *Schema {
	t.Helper()
	admin := openAdmin(t)
	defer admin.Close()
	dropStale(context.Background(), admin, "SELECT nspname FROM pg_namespace", "nspname", schemaPrefix, "DROP SCHEMA IF EXISTS %s CASCADE")
	return newSchema(t, admin, sessionURL(URL()))
}

// openAdmin opens a pool on the test server's URL and checks that it answers.
func openAdmin(t testing.TB) *sql.DB {
	t.Helper()
	admin, err := OpenURL(URL())
	if err != nil {
		t.Fatalf("testdb: open %s: %v", URL(), err)
	}
	if err := admin.PingContext(context.Background()); err != nil {
		_ = admin.Close()
		t.Fatalf("testdb: PostgreSQL is not reachable at %s (set OUTBOX_TEST_DATABASE_URL or run `make db`): %v", URL(), err)
	}
	return admin
}

// sessionURL is base with the session settings of every connection to a
// test schema on the shared server: synchronous_commit=off (unless base
// sets it). A commit then returns once its WAL is written, not flushed: the
// same visibility, locks and order for every client, only a server crash
// could lose the last commits, and the shared server is never crashed (the
// tests that stop a server use their own cluster, Throwaway, where this is
// not set). Measured on the CI machine: 8.5 ms per commit flushed, 0.9 ms
// not; a test schema's migrations commit dozens of times and a relay
// several times per pass.
func sessionURL(base string) string {
	if strings.Contains(base, "synchronous_commit") {
		return base
	}
	return withParam(base, "synchronous_commit", "off")
}

// IdleConns is how many idle connections a pool on a test schema keeps
// (database/sql's default is 2). With 2, a test whose relays run more
// statements at once closed and reopened connections all the time, each a
// new server backend (fork and authentication): the four-relay flap test
// opened about 1,200 connections a minute, most of its time. SetMaxOpenConns
// below it lowers it too (database/sql keeps no more idle than open); a test
// that raises MaxOpenConns above it should raise this with it.
const IdleConns = 24

// newSchema creates a schema on the server admin is connected to (base is
// that server's URL), migrates it, and drops it in t.Cleanup.
func newSchema(t testing.TB, admin *sql.DB, base string) *Schema {
	t.Helper()
	ctx := context.Background()
	name := fmt.Sprintf("%s%d_%s", schemaPrefix, time.Now().Unix(), randomHex(4))
	if _, err := admin.ExecContext(ctx, "CREATE SCHEMA "+name); err != nil {
		t.Fatalf("testdb: create schema on %s: %v", base, err)
	}
	s := &Schema{Name: name, URL: WithSearchPath(base, name)}
	var err error
	s.DB, err = OpenURL(s.URL)
	if err != nil {
		t.Fatalf("testdb: open schema: %v", err)
	}
	s.DB.SetMaxIdleConns(IdleConns)
	t.Cleanup(func() {
		_ = s.DB.Close()
		drop, err := OpenURL(base)
		if err != nil {
			return
		}
		defer drop.Close()
		_, _ = drop.ExecContext(context.Background(), "DROP SCHEMA IF EXISTS "+name+" CASCADE")
	})
	if err := migrateFresh(ctx, s.DB); err != nil {
		t.Fatalf("testdb: migrate %s: %v", name, err)
	}
	return s
}

// CommitOfAbortedTx reports whether err is a driver's refusal to commit a
// transaction an earlier statement aborted: lib/pq's ErrInFailedTransaction,
// or pgx's "commit unexpectedly resulted in rollback" (pgx.ErrTxCommitRollback).
func CommitOfAbortedTx(err error) bool {
	return err != nil && (errors.Is(err, pq.ErrInFailedTransaction) ||
		strings.Contains(err.Error(), "commit unexpectedly resulted in rollback"))
}

// Open returns a new pool on the schema (a second "process" view of it).
func (s *Schema) Open(t testing.TB) *sql.DB {
	t.Helper()
	db, err := OpenURL(s.URL)
	if err != nil {
		t.Fatalf("testdb: open: %v", err)
	}
	db.SetMaxIdleConns(IdleConns)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// Count returns the result of SELECT count(*) FROM messaging_outbox WHERE <where>.
// where is trusted test SQL; args are bound.
func (s *Schema) Count(t testing.TB, where string, args ...any) int {
	t.Helper()
	q := "SELECT count(*) FROM messaging_outbox"
	if where != "" {
		q += " WHERE " + where
	}
	return QueryInt(t, s.DB, q, args...)
}

// dropStale drops what a crashed run left over an hour ago: the names in
// column col of list (a catalog query) that start with prefix and the Unix
// time a run stamped on them, each by dropFmt (a DROP with %s for the name).
func dropStale(ctx context.Context, db *sql.DB, list, col, prefix, dropFmt string) {
	rows, err := db.QueryContext(ctx, list+" WHERE "+col+" LIKE '"+prefix+"%'")
	if err != nil {
		return
	}
	var stale []string
	cutoff := time.Now().Add(-time.Hour).Unix()
	for rows.Next() {
		var name string
		if rows.Scan(&name) != nil {
			continue
		}
		ts, _, _ := strings.Cut(strings.TrimPrefix(name, prefix), "_")
		if n, err := strconv.ParseInt(ts, 10, 64); err == nil && n < cutoff {
			stale = append(stale, name)
		}
	}
	_ = rows.Close()
	for _, name := range stale {
		_, _ = db.ExecContext(ctx, fmt.Sprintf(dropFmt, name))
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
