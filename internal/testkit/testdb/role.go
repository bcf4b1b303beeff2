package testdb

import (
	"context"
	"errors"
	neturl "net/url"
	"strings"
	"testing"
)

// Role creates a login role for this test only (outbox_test_role_<random>,
// no password: the test server trusts local logins), grants it USAGE on the
// schema, runs each grant with %[1]s replaced by the role's name and the
// schema on the search_path, and returns the role's name and a URL that
// connects as it with the schema on its search_path. The role loses its
// privileges and is dropped in t.Cleanup (its sessions terminated first).
// The server URL must be in URL form.
func (s *Schema) Role(t testing.TB, grants ...string) (name, url string) {
	t.Helper()
	ctx := context.Background()
	name = "outbox_test_role_" + randomHex(4)
	admin, err := OpenURL(s.URL) // the schema's database (Isolated: not the shared one)
	if err != nil {
		t.Fatalf("testdb: open: %v", err)
	}
	defer admin.Close()
	for _, q := range append([]string{"CREATE ROLE " + name + " LOGIN", "GRANT USAGE ON SCHEMA " + s.Name + " TO %[1]s"}, grants...) {
		q = strings.ReplaceAll(q, "%[1]s", name)
		if _, err := admin.ExecContext(ctx, q); err != nil {
			t.Fatalf("testdb: role %s: %s: %v", name, q, err)
		}
	}
	t.Cleanup(func() {
		drop, err := OpenURL(s.URL) // DROP OWNED acts on the database it runs in
		if err != nil {
			return
		}
		defer drop.Close()
		_, _ = drop.ExecContext(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, name)
		_, _ = drop.ExecContext(context.Background(), "DROP OWNED BY "+name)
		_, _ = drop.ExecContext(context.Background(), "DROP ROLE IF EXISTS "+name)
	})
	url, err = RoleURL(s.URL, name)
	if err != nil {
		t.Fatal(err)
	}
	return name, url
}

// RoleURL returns base (a postgres:// URL) connecting as role, without a
// password (the test server trusts local logins).
func RoleURL(base, role string) (string, error) {
	u, err := neturl.Parse(base)
	if err != nil || !strings.HasPrefix(u.Scheme, "postgres") {
		return "", errors.New("testdb: a login role needs OUTBOX_TEST_DATABASE_URL in URL form (postgres://...)")
	}
	u.User = neturl.User(role)
	return u.String(), nil
}
