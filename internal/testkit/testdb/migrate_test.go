package testdb_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// catalogOf describes every object of schema that a migration can create or
// change, one line each, with the schema's name replaced by "S": relations
// and their options, columns, defaults and generated expressions,
// constraints, indexes, triggers, functions (their whole definitions),
// grants, comments, and the goose version table's rows.
const catalogOf = `
WITH n AS (SELECT oid, nspname FROM pg_namespace WHERE nspname = $1)
SELECT line FROM (
  SELECT format('rel %s %s %s %s %s', c.relname, c.relkind, c.reloptions, c.relacl, obj_description(c.oid)) AS line
    FROM pg_class c JOIN n ON c.relnamespace = n.oid
  UNION ALL
  SELECT format('col %s.%s %s notnull=%s gen=%s ident=%s def=%s comment=%s', c.relname, a.attname,
                format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attgenerated, a.attidentity,
                pg_get_expr(d.adbin, d.adrelid), col_description(c.oid, a.attnum))
    FROM pg_class c JOIN n ON c.relnamespace = n.oid
    JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
  UNION ALL
  SELECT format('con %s.%s %s', c.relname, k.conname, pg_get_constraintdef(k.oid))
    FROM pg_constraint k JOIN pg_class c ON k.conrelid = c.oid JOIN n ON c.relnamespace = n.oid
  UNION ALL
  SELECT format('idx %s', pg_get_indexdef(i.indexrelid))
    FROM pg_index i JOIN pg_class c ON i.indrelid = c.oid JOIN n ON c.relnamespace = n.oid
  UNION ALL
  SELECT format('trg %s', pg_get_triggerdef(t.oid))
    FROM pg_trigger t JOIN pg_class c ON t.tgrelid = c.oid JOIN n ON c.relnamespace = n.oid
   WHERE NOT t.tgisinternal
  UNION ALL
  SELECT format('fn %s acl=%s comment=%s %s', p.proname, p.proacl, obj_description(p.oid), pg_get_functiondef(p.oid))
    FROM pg_proc p JOIN n ON p.pronamespace = n.oid
  UNION ALL
  SELECT format('type %s %s', t.typname, t.typtype)
    FROM pg_type t JOIN n ON t.typnamespace = n.oid
) lines ORDER BY line`

func catalog(t *testing.T, db *sql.DB, schema string) []string {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), catalogOf, schema)
	if err != nil {
		t.Fatalf("read the catalog of %s: %v", schema, err)
	}
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, strings.ReplaceAll(line, schema, "S"))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	versions, err := db.QueryContext(context.Background(),
		fmt.Sprintf(`SELECT version_id, is_applied FROM %s.%s ORDER BY id`, schema, migrations.VersionTable))
	if err != nil {
		t.Fatalf("read the versions of %s: %v", schema, err)
	}
	defer versions.Close()
	for versions.Next() {
		var v int64
		var applied bool
		if err := versions.Scan(&v, &applied); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, fmt.Sprintf("version %d applied=%v", v, applied))
	}
	return lines
}

// A test schema (migrations replayed in one statement, migrate.go) has the
// same catalog, down to function bodies, grants, comments and the version
// table's rows, as a schema migrated by migrations.Up; and migrations.Up
// finds nothing left to apply on it.
func TestReplayedSchemaMatchesMigrated(t *testing.T) {
	ctx := context.Background()
	replayed := testdb.New(t)

	admin, err := testdb.OpenURL(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	name := fmt.Sprintf("outbox_test_%d_goose%d", time.Now().Unix(), time.Now().UnixNano()%1000000)
	if _, err := admin.ExecContext(ctx, "CREATE SCHEMA "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.ExecContext(context.Background(), "DROP SCHEMA IF EXISTS "+name+" CASCADE") })
	migrated, err := testdb.OpenURL(testdb.WithSearchPath(testdb.URL(), name))
	if err != nil {
		t.Fatal(err)
	}
	defer migrated.Close()
	if _, err := migrations.Up(ctx, migrated); err != nil {
		t.Fatalf("migrations.Up: %v", err)
	}

	want, got := catalog(t, admin, name), catalog(t, admin, replayed.Name)
	if len(want) < 50 {
		t.Fatalf("the migrated schema's catalog has %d lines; the query reads nothing", len(want))
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		for i := 0; i < max(len(got), len(want)); i++ {
			var g, w string
			if i < len(got) {
				g = got[i]
			}
			if i < len(want) {
				w = want[i]
			}
			if g != w {
				t.Errorf("first difference at line %d:\n replayed: %s\n migrated: %s", i, g, w)
				break
			}
		}
		t.Fatalf("the replayed schema (%d lines) differs from the migrated one (%d lines)", len(got), len(want))
	}

	res, err := migrations.Up(ctx, replayed.DB)
	if err != nil {
		t.Fatalf("migrations.Up on the replayed schema: %v", err)
	}
	if len(res.Applied) != 0 || res.Current != migrations.Latest() {
		t.Fatalf("migrations.Up on the replayed schema applied %v and left version %d, want nothing applied at %d",
			res.Applied, res.Current, migrations.Latest())
	}
}
