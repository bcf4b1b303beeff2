package main

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"strings"

	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// The business tables live in the same schema as the outbox tables: the
// order and its event must commit in one local transaction.
const createBusinessTables = `
CREATE TABLE IF NOT EXISTS orders (
    id          text        PRIMARY KEY,
    customer_id text        NOT NULL,
    tenant      text        NOT NULL,
    item        text        NOT NULL,
    quantity    int         NOT NULL CHECK (quantity > 0),
    total_cents bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
-- The consumer's effect. It is written in the inbox transaction, so a
-- redelivered OrderPlaced cannot create a second shipment.
CREATE TABLE IF NOT EXISTS shipments (
    order_id    text        PRIMARY KEY,
    customer_id text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);`

// openDatabase connects with search_path set to the schema the URL names
// (or defaultSchema), creates that schema when missing, and migrates the
// outbox tables and the business tables into it.
func openDatabase(ctx context.Context, rawURL string) (*sql.DB, string, error) {
	dsn, schema, err := withSchema(rawURL)
	if err != nil {
		return nil, "", err
	}
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return nil, "", err
	}
	// Relay, listener, consumer and HTTP handler share a small pool; the
	// server's connections are shared with everyone else on the machine.
	db.SetMaxOpenConns(8)
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, "", fmt.Errorf("connect to PostgreSQL (%s): %w (start one with `make db`)", redact(rawURL), err)
	}
	// search_path is resolved per statement, so creating the schema on a
	// connection that already names it is enough.
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+pq.QuoteIdentifier(schema)); err != nil {
		_ = db.Close()
		return nil, "", fmt.Errorf("create schema %s: %w", schema, err)
	}
	if _, err := migrations.Up(ctx, db); err != nil {
		_ = db.Close()
		return nil, "", fmt.Errorf("migrate: %w", err)
	}
	if _, err := db.ExecContext(ctx, createBusinessTables); err != nil {
		_ = db.Close()
		return nil, "", fmt.Errorf("create business tables: %w", err)
	}
	return db, dsn, nil
}

// withSchema returns the URL with search_path set (kept when the URL names
// one) and the schema that holds the tables.
func withSchema(rawURL string) (string, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", "", fmt.Errorf("OUTBOX_DATABASE_URL must be a postgres:// URL, got %q", redact(rawURL))
	}
	q := u.Query()
	path := q.Get("search_path")
	if path == "" {
		q.Set("search_path", defaultSchema)
		u.RawQuery = q.Encode()
		return u.String(), defaultSchema, nil
	}
	first := strings.TrimSpace(strings.Split(path, ",")[0])
	return rawURL, strings.Trim(first, `"`), nil
}

// redact drops the password from a URL before it is printed.
func redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}
