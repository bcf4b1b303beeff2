package testdb

import (
	"context"
	"fmt"
	neturl "net/url"
	"testing"
	"time"
)

const databasePrefix = "outbox_testdb_"

// Isolated is New in a database of its own on the test server, created for
// the test and dropped when it ends. It is for tests whose subject looks at
// every transaction of the database: the lane floors (fencing.AdvanceLaneFloors)
// wait for every transaction of their database that could still commit a
// row, and in the shared database the other suites' long-open transactions
// (the same floor tests of the pgx job among them) held them back for as
// long as those ran. Creating a database copies template1 and costs more
// than a schema; use New for everything else.
func Isolated(t testing.TB) *Schema {
	t.Helper()
	ctx := context.Background()
	admin := openAdmin(t)
	defer admin.Close()
	dropStale(ctx, admin, "SELECT datname FROM pg_database", "datname", databasePrefix, "DROP DATABASE IF EXISTS %s WITH (FORCE)")
	name := fmt.Sprintf("%s%d_%s", databasePrefix, time.Now().Unix(), randomHex(4))
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("testdb: create database: %v", err)
	}
	t.Cleanup(func() {
		drop, err := OpenURL(URL())
		if err != nil {
			return
		}
		defer drop.Close()
		// FORCE: a connection a test left open must not keep the database.
		_, _ = drop.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	base := withDatabase(URL(), name)
	dbAdmin, err := OpenURL(base)
	if err != nil {
		t.Fatalf("testdb: open %s: %v", name, err)
	}
	defer dbAdmin.Close()
	return newSchema(t, dbAdmin, sessionURL(base))
}

// withDatabase returns base with its database set to name.
func withDatabase(base, name string) string {
	u, err := neturl.Parse(base)
	if err != nil || u.Scheme == "" {
		return base + " dbname=" + name
	}
	u.Path = "/" + name
	return u.String()
}
