package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/stretchr/testify/require"
)

// inspect previews a payload within a bound, escapes what a terminal would
// act on, shows binary as hex with the full size, and writes the raw bytes
// only where --payload-to says.
func TestInspectPreviewIsBoundedAndEscaped(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	// 2 MB of text that starts by clearing the screen and retitling the
	// terminal; a destination and a header that try the same.
	big := "\x1b[2J\x1b]0;pwned\x07" + strings.Repeat("a", 2_000_000)
	exec1(t, s.DB, `INSERT INTO messaging_outbox (message_id, destination, payload, headers, last_failure_detail, status, parked_at, last_failure_code)
VALUES ('big', E'orders\x1b[2J', convert_to($1, 'UTF8'), '{"k":"v\u001b[31m"}', E'line1\nforged=line', 'FAILED', now(), 'X'),
       ('bin', 'orders', '\x00ff1b0a'::bytea, '{}', NULL, 'PENDING', NULL, NULL)`, big)

	r := db(t, s, "inspect", "big")
	requireCode(t, r, 0)
	require.Less(t, len(r.stdout), 8192, "the preview is bounded")
	require.NotContains(t, r.stdout, "\x1b", "no raw ESC reaches the terminal")
	require.NotContains(t, r.stdout, "\x07")
	require.Regexp(t, `(?m)^payload\s+2000014 bytes, text, first 512 shown: \\x1b\[2J\\x1b\]0;pwned\\aaaa+\.\.\.$`, r.stdout)
	require.Regexp(t, `(?m)^destination\s+orders\\x1b\[2J$`, r.stdout)
	require.Regexp(t, `(?m)^last_failure_detail\s+line1\\nforged=line$`, r.stdout)
	require.Contains(t, r.stdout, `"v\x1b[31m"`)

	r = db(t, s, "inspect", "bin", "--payload-bytes", "2")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^payload\s+4 bytes, binary \(hex\), first 2 shown: 00ff\.\.\.$`, r.stdout)
	r = db(t, s, "inspect", "bin")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^payload\s+4 bytes, binary \(hex\): 00ff1b0a$`, r.stdout)

	// --payload-to FILE: the raw bytes, mode 0600; a symlink there is
	// replaced, its target left alone.
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	require.NoError(t, os.WriteFile(target, []byte("keep"), 0o644))
	out := filepath.Join(dir, "payload.bin")
	require.NoError(t, os.Symlink(target, out))
	r = db(t, s, "inspect", "big", "--payload-to", out)
	requireCode(t, r, 0)
	got, err := os.ReadFile(out)
	require.NoError(t, err)
	require.Equal(t, []byte(big), got)
	fi, err := os.Lstat(out)
	require.NoError(t, err)
	require.True(t, fi.Mode().IsRegular())
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	kept, err := os.ReadFile(target)
	require.NoError(t, err)
	require.Equal(t, "keep", string(kept))
	require.Contains(t, r.stderr, "wrote 2000014 payload bytes to "+out)

	// --payload-to -: only the raw bytes on stdout, for a pipe.
	r = db(t, s, "inspect", "bin", "--payload-to", "-")
	requireCode(t, r, 0)
	require.True(t, bytes.Equal([]byte{0x00, 0xff, 0x1b, 0x0a}, []byte(r.stdout)))

	// status escapes the same way.
	r = db(t, s, "status")
	requireCode(t, r, 0)
	require.NotContains(t, r.stdout, "\x1b")
	require.Contains(t, r.stdout, `orders\x1b[2J`)
}

// A list status cuts says how many more there are.
func TestStatusSaysHowManyMoreStuck(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	var rows []testdb.OutboxRow
	for g := 1; g <= 25; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: "p-" + strconv.Itoa(g), Destination: "orders", Payload: []byte("x"),
			Status: envelope.StatusFailed, LastFailureCode: "X", CorrelationID: "flow-" + strconv.Itoa(g)}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	r := db(t, s, "status")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "... and 5 more (--max-stuck shows more)\n")
	r = db(t, s, "status", "--max-stuck", "25")
	requireCode(t, r, 0)
	require.NotContains(t, r.stdout, "more (--max-stuck")
	r = db(t, s, "--json", "status", "--max-stuck", "3")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, `"stuck_total": 25`)
}
