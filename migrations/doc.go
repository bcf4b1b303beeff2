// Package migrations owns the SQL of watermill-outbox: the messaging_outbox
// table (34 columns, the generated routing_key, and created_at_utc, a generated copy of created_at for the CDC router), messaging_admin_operation,
// messaging_inbox, the relay-mode tables and the retention archive. The files
// are embedded and are the single source of truth; nothing else in the module
// creates tables.
//
// [Up] applies them with goose (github.com/pressly/goose/v3) under a
// PostgreSQL advisory lock, so replicas that all migrate at start-up are safe.
// It records versions in [VersionTable] in the schema the connection's
// search_path names first, which is how the tables are placed in a
// non-public schema:
//
//	db, _ := sql.Open("postgres", "postgres://.../app?search_path=messaging")
//	_, err := migrations.Up(ctx, db)
//
// Teams that run their own migration tool take the files from [FS] (or copy
// them from the repository's migrations/sql folder): goose reads them as they
// are; for Flyway or golang-migrate use the text between "-- +goose Up" and
// "-- +goose Down" as the up migration of the same version number.
package migrations
