package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx" (-driver pgx)
	_ "github.com/lib/pq"              // database/sql driver "postgres"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// benchDBPrefix names the database a run creates for itself. A dedicated
// database makes pg_stat_database's xact_commit count only this run's
// transactions: the server is shared with other test runs, whose commits
// would otherwise be counted as the relay's idle load.
const benchDBPrefix = "outbox_bench_"

var identRE = regexp.MustCompile(`^[a-z0-9_]+$`)

// env is the run's database: created at start, dropped at the end.
type env struct {
	dbName string
	dbURL  string // the bench database
	admin  *sql.DB
	// fillfactor, when non-zero, is set on messaging_outbox in every schema.
	fillfactor int
	// dbOID is the bench database's oid; walinspect whether pg_walinspect
	// could be created in it (ownWAL).
	dbOID      int64
	walinspect error
	// walDetail prints where each drain's own WAL went (-wal-detail).
	walDetail bool
	// driver is the database/sql driver of the schemas' pools, the
	// relays' and writers' connections (-driver): "postgres" (lib/pq) or
	// "pgx" (pgx's stdlib, binary results where pgx knows the type).
	driver string
}

func withDatabase(base, db string) (string, error) {
	u, err := url.Parse(base)
	if err != nil || u.Scheme == "" {
		return "", fmt.Errorf("database URL %q must be a postgres:// URL", base)
	}
	u.Path = "/" + db
	return u.String(), nil
}

func suffix() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%d_%s", time.Now().Unix(), hex.EncodeToString(b))
}

func newEnv(ctx context.Context, baseURL string) (*env, error) {
	admin, err := sql.Open("postgres", baseURL)
	if err != nil {
		return nil, err
	}
	admin.SetMaxOpenConns(2)
	if err := admin.PingContext(ctx); err != nil {
		_ = admin.Close()
		return nil, fmt.Errorf("PostgreSQL is not reachable at %s (set OUTBOX_TEST_DATABASE_URL or run `make db`): %w", baseURL, err)
	}
	dropStaleDatabases(ctx, admin)
	e := &env{admin: admin, dbName: benchDBPrefix + suffix()}
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+e.dbName); err != nil {
		_ = admin.Close()
		return nil, fmt.Errorf("create database %s: %w", e.dbName, err)
	}
	if e.dbURL, err = withDatabase(baseURL, e.dbName); err != nil {
		e.close()
		return nil, err
	}
	if err := admin.QueryRowContext(ctx, `SELECT oid FROM pg_database WHERE datname = $1`, e.dbName).Scan(&e.dbOID); err != nil {
		e.close()
		return nil, err
	}
	// pg_walinspect (contrib, PostgreSQL 15+) reads which WAL records were
	// this database's (ownWAL); without it those cells are 0.
	if _, err := e.exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_walinspect WITH SCHEMA public"); err != nil {
		e.walinspect = fmt.Errorf("pg_walinspect: %w", err)
	}
	return e, nil
}

// ownWALSQL groups the WAL records between $1 and $2 that are this
// database's by the relation of their block reference and their record
// type: the records with a block reference to one of its relations ($3: "
// rel <tablespace>/<database oid>/"), and the commit and abort records of
// the transactions that wrote such records (one group, relation "-").
// Full-page images are in record_length, and apart in fpi_length; the
// records that carry one are counted apart too.
const ownWALSQL = `
WITH r AS MATERIALIZED (
    SELECT xid, resource_manager, record_type, record_length, fpi_length, block_ref,
           substring(block_ref from ' rel \d+/\d+/(\d+)')::oid AS node
      FROM public.pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
),
mine AS (SELECT DISTINCT xid FROM r WHERE block_ref LIKE $3 AND xid <> '0'::xid)
SELECT coalesce(c.relname, r.node::text, '-'), r.resource_manager || '/' || r.record_type,
       count(*), count(*) FILTER (WHERE r.fpi_length > 0), sum(r.record_length)::int8, sum(r.fpi_length)::int8
  FROM r LEFT JOIN pg_class c ON c.relfilenode = r.node
 WHERE r.block_ref LIKE $3 OR (coalesce(r.block_ref, '') = '' AND r.xid IN (SELECT xid FROM mine))
 GROUP BY 1, 2 ORDER BY 5 DESC`

// ownWAL is the WAL this run's database wrote between two positions (the
// server is shared, and a cluster-wide LSN difference counts every other
// database's writes in the same range), and the part of it that is
// full-page images; with -wal-detail it prints the 20 largest groups of
// ownWALSQL to stderr. It errors when pg_walinspect is not available or
// the range is no longer on disk (a checkpoint recycled it).
func (e *env) ownWAL(ctx context.Context, from, to string) (total, fpi float64, err error) {
	if e.walinspect != nil {
		return 0, 0, e.walinspect
	}
	db, err := sql.Open("postgres", e.dbURL)
	if err != nil {
		return 0, 0, err
	}
	defer db.Close()
	// The records up to `to` must be flushed before they can be read (the
	// WAL writer flushes within wal_writer_delay).
	for deadline := time.Now().Add(5 * time.Second); ; {
		var flushed bool
		if err := db.QueryRowContext(ctx, `SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn`, to).Scan(&flushed); err != nil {
			return 0, 0, err
		}
		if flushed {
			break
		}
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("WAL up to %s not flushed after 5 s", to)
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	pattern := fmt.Sprintf("%% rel %%/%d/%%", e.dbOID)
	rows, err := db.QueryContext(ctx, ownWALSQL, from, to, pattern)
	if err != nil {
		return 0, 0, fmt.Errorf("pg_get_wal_records_info: %w", err)
	}
	defer rows.Close()
	for shown := 0; rows.Next(); shown++ {
		var rel, kind string
		var n, pages, bytes, images int64
		if err := rows.Scan(&rel, &kind, &n, &pages, &bytes, &images); err != nil {
			return 0, 0, err
		}
		total, fpi = total+float64(bytes), fpi+float64(images)
		if e.walDetail && shown < 20 {
			fmt.Fprintf(os.Stderr, "  wal %-40s %-28s %8d records %12d B (%d with a full-page image: %d B)\n", rel, kind, n, bytes, pages, images)
		}
	}
	if err := rows.Err(); err != nil {
		return 0, 0, fmt.Errorf("pg_get_wal_records_info: %w", err)
	}
	return total, fpi, nil
}

func (e *env) close() {
	_, _ = e.admin.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+e.dbName+" WITH (FORCE)")
	_ = e.admin.Close()
}

// xacts returns committed + rolled back transactions of the bench database
// so far (pg_stat_database, flushed by backends at most once a second and at
// exit).
func (e *env) xacts(ctx context.Context) (int64, error) {
	var n int64
	err := e.admin.QueryRowContext(ctx,
		`SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1`, e.dbName).Scan(&n)
	return n, err
}

// dropStaleDatabases removes bench databases left by crashed runs (older
// than an hour).
func dropStaleDatabases(ctx context.Context, admin *sql.DB) {
	rows, err := admin.QueryContext(ctx, `SELECT datname FROM pg_database WHERE datname LIKE 'outbox\_bench\_%'`)
	if err != nil {
		return
	}
	var stale []string
	cutoff := time.Now().Add(-time.Hour).Unix()
	for rows.Next() {
		var name string
		if rows.Scan(&name) != nil || !identRE.MatchString(name) {
			continue
		}
		ts, _, _ := strings.Cut(strings.TrimPrefix(name, benchDBPrefix), "_")
		if n, err := strconv.ParseInt(ts, 10, 64); err == nil && n < cutoff {
			stale = append(stale, name)
		}
	}
	_ = rows.Close()
	for _, name := range stale {
		_, _ = admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	}
}

// schema is one scenario's fresh, migrated schema in the bench database.
type schema struct {
	name string
	url  string
	db   *sql.DB
	e    *env
}

// newSchema creates and migrates a schema; pool is the pool size the
// scenario needs (PostgreSQL's max_connections is shared by everyone).
func (e *env) newSchema(ctx context.Context, pool int) (*schema, error) {
	name := "bench_" + suffix()
	if _, err := e.exec(ctx, "CREATE SCHEMA "+name); err != nil {
		return nil, fmt.Errorf("create schema: %w", err)
	}
	s := &schema{name: name, url: testdb.WithSearchPath(e.dbURL, name), e: e}
	db, err := sql.Open(e.driverName(), s.url)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(pool)
	db.SetMaxIdleConns(pool)
	s.db = db
	if _, err := migrations.Up(ctx, db); err != nil {
		s.drop()
		return nil, fmt.Errorf("migrate %s: %w", name, err)
	}
	if e.fillfactor != 0 {
		if _, err := db.ExecContext(ctx, fmt.Sprintf("ALTER TABLE messaging_outbox SET (fillfactor = %d)", e.fillfactor)); err != nil {
			s.drop()
			return nil, fmt.Errorf("fillfactor %d: %w", e.fillfactor, err)
		}
	}
	return s, nil
}

// driverName is the driver of the schemas' pools (lib/pq by default).
func (e *env) driverName() string { return cmp.Or(e.driver, "postgres") }

// exec runs a statement in the bench database (not the admin one).
func (e *env) exec(ctx context.Context, q string) (sql.Result, error) {
	db, err := sql.Open("postgres", e.dbURL)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	return db.ExecContext(ctx, q)
}

func (s *schema) drop() {
	if s.db != nil {
		_ = s.db.Close()
	}
	_, _ = s.e.exec(context.Background(), "DROP SCHEMA IF EXISTS "+s.name+" CASCADE")
}

// open returns another pool on the schema (another "process").
func (s *schema) open(pool int) (*sql.DB, error) {
	db, err := sql.Open(s.e.driverName(), s.url)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(pool)
	db.SetMaxIdleConns(pool)
	return db, nil
}
