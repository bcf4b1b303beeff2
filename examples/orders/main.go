// Command orders is the demo `make demo` runs, and a template to copy: an
// order service writes each order and its OrderPlaced event in one
// PostgreSQL transaction (the outbox), the fenced relay forwards the
// committed events to Google Cloud Pub/Sub, and a shipping consumer on a
// watermill router creates one shipment per order through the inbox, so a
// redelivered event does not ship twice.
//
// Everything runs in one process on local defaults:
//
//   - PostgreSQL from OUTBOX_DATABASE_URL (default
//     postgres://postgres@127.0.0.1:5432/test?sslmode=disable); the tables go
//     into the first schema of the URL's search_path, or "outbox_demo" when
//     the URL names none (created if missing);
//   - Pub/Sub in-process (pstest) unless PUBSUB_EMULATOR_HOST (an emulator)
//     or GOOGLE_CLOUD_PROJECT (a real project, application default
//     credentials) is set.
//
// It exits 0 only when every committed order was received and shipped
// exactly once and the rolled-back order never left the database.
package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/signal"
	"time"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultSchema      = "outbox_demo"
	// The demo must end by itself; everything normally settles in seconds.
	deadline = 45 * time.Second
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()

	url := cmp.Or(os.Getenv("OUTBOX_DATABASE_URL"), defaultDatabaseURL)
	if err := run(ctx, url, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}
