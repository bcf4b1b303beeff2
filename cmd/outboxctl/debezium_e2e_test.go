package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func TestDebeziumConfigEqualsGenerator(t *testing.T) {
	t.Parallel()
	var want bytes.Buffer
	require.NoError(t, debezium.Generate(debezium.Options{TopicPrefix: "acme."}).WriteJSON(&want))
	// No database needed to generate a configuration.
	r := cli(t, nil, "debezium", "config", "--topic-prefix", "acme.")
	requireCode(t, r, 0)
	require.Equal(t, want.String(), r.stdout)

	want.Reset()
	require.NoError(t, debezium.Generate(debezium.Options{}).WriteProperties(&want))
	file := filepath.Join(t.TempDir(), "c.properties")
	r = cli(t, nil, "debezium", "config", "--format", "properties", "-o", file)
	requireCode(t, r, 0)
	got, err := os.ReadFile(file)
	require.NoError(t, err)
	require.Equal(t, want.String(), string(got))

	// The shipped files are exactly what the command writes.
	shipped, err := os.ReadFile("../../debezium/outbox-connector.properties")
	require.NoError(t, err)
	require.Equal(t, string(shipped), string(got))

	r = cli(t, nil, "debezium", "config", "--format", "yaml")
	requireCode(t, r, 2)
	r = cli(t, nil, "debezium", "config", "--topic-prefix", "bad$")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "OUTBOX_INVALID_CONFIG")
}

func TestDebeziumEnableRefusedWhileRelaysLive(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	ctx := context.Background()
	require.NoError(t, relaymode.Beat(ctx, s.DB, "relay-a", time.Hour))

	r := db(t, s, "debezium", "enable", "--by", "ops")
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "code: RELAY_MODE_CONFLICT")
	require.Contains(t, r.stderr, "relay-a")

	require.NoError(t, relaymode.Leave(ctx, s.DB, "relay-a"))
	r = db(t, s, "debezium", "enable", "--by", "ops")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "relay mode: CDC")
	// The forwarder's guard now refuses a polling relay.
	require.ErrorIs(t, relaymode.Beat(ctx, s.DB, "relay-b", time.Hour), relaymode.ErrRelayModeConflict)

	r = db(t, s, "--json", "debezium", "status")
	requireCode(t, r, 0)
	var st map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Equal(t, "CDC", st["relay_mode"])

	requireCode(t, db(t, s, "debezium", "disable", "--by", ""), 2) // RELAY_MODE_OPERATOR_REQUIRED
	// An operator name PostgreSQL cannot store or a terminal would act on
	// is refused before the database is touched: a usage error with its code.
	for _, sub := range []string{"enable", "disable"} {
		for _, by := range []string{"\xff", "ops\x1b[2J", "ops\nforged", "ops\u0085"} {
			r = db(t, s, "debezium", sub, "--by", by)
			requireCode(t, r, 2)
			require.Contains(t, r.stderr, "code: OUTBOXCTL_USAGE", "%s --by %q", sub, by)
			require.NotContains(t, r.stderr, "\x1b", "%s --by %q", sub, by)
		}
	}
	r = db(t, s, "debezium", "status")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "relay mode: CDC", "the refused disable changed nothing")
	r = db(t, s, "debezium", "disable", "--by", "ops")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "relay mode: POLLING")
	require.NoError(t, relaymode.Beat(ctx, s.DB, "relay-b", time.Hour))
}

// debezium config -o writes 0600 through a rename: a symlink at the path is
// replaced, its target untouched.
func TestDebeziumConfigOutputFileIsSafe(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	target := filepath.Join(dir, "elsewhere")
	require.NoError(t, os.WriteFile(target, []byte("keep"), 0o644))
	out := filepath.Join(dir, "connector.json")
	require.NoError(t, os.Symlink(target, out))
	r := cli(t, nil, "debezium", "config", "-o", out)
	requireCode(t, r, 0)
	fi, err := os.Lstat(out)
	require.NoError(t, err)
	require.True(t, fi.Mode().IsRegular())
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	kept, err := os.ReadFile(target)
	require.NoError(t, err)
	require.Equal(t, "keep", string(kept))
	body, err := os.ReadFile(out)
	require.NoError(t, err)
	require.True(t, json.Valid(body))
}
