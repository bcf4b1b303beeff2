// Package examples_test runs every example with its default settings against
// the test PostgreSQL, each in a fresh schema (so parallel runs cannot
// collide), and checks the exit code and the final line of its transcript.
package examples_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// resultLine is the last line every example prints.
var resultLine = regexp.MustCompile(`(?m)^received (\d+) of (\d+), rolled back (\d+)$`)

func TestExamplesRunWithDefaults(t *testing.T) {
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	goBin := goBinary(t)

	cases := []struct {
		dir  string
		also []string // further lines the transcript must show
	}{
		{dir: "orders", also: []string{"inbox already holds", "ROLLED BACK", "relay    pass: claimed="}},
		{dir: "router-migration", also: []string{"rolled back (order amount above the limit)"}},
		{dir: "legacy-sql", also: []string{"refused (email taken), rolled back"}},
		{dir: "kafka", also: []string{"inbox already holds", "ROLLED BACK", "partition="}},
		{dir: "pgx", also: []string{
			"duplicate message id         -> refused: OUTBOX_DUPLICATE_MESSAGE_ID",
			"read-only transaction        -> refused: OUTBOX_TRANSACTION_REQUIRED",
			"aborted transaction          -> refused: OUTBOX_TRANSACTION_REQUIRED",
			"outside a transaction        -> refused: OUTBOX_TRANSACTION_REQUIRED",
			"relay    woke and relayed: claimed=",
		}},
	}
	for _, tc := range cases {
		t.Run(tc.dir, func(t *testing.T) {
			t.Parallel()
			bin := filepath.Join(t.TempDir(), tc.dir)
			args := []string{"build", "-o", bin}
			build := exec.Command(goBin, append(args, "./examples/"+tc.dir)...)
			build.Dir = root
			out, err := build.CombinedOutput()
			require.NoError(t, err, "go build %s:\n%s", tc.dir, out)

			s := testdb.New(t) // a fresh schema; the example migrates it again (a no-op) and adds its tables
			s.DB.SetMaxOpenConns(1)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin)
			cmd.Env = append(cleanEnv(), "OUTBOX_DATABASE_URL="+s.URL)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			start := time.Now()
			err = cmd.Run()
			transcript := stdout.String()
			require.NoError(t, err, "%s exited with an error after %s\nstdout:\n%s\nstderr:\n%s", tc.dir, time.Since(start), transcript, stderr.String())

			m := resultLine.FindStringSubmatch(transcript)
			require.NotNil(t, m, "no result line in:\n%s", transcript)
			require.NotEqual(t, "0", m[2], "the example committed nothing:\n%s", transcript)
			require.Equal(t, m[2], m[1], "not every committed message was received exactly once:\n%s", transcript)
			require.Equal(t, "0", m[3], "a rolled-back message was received:\n%s", transcript)
			require.True(t, strings.HasSuffix(strings.TrimSpace(transcript), m[0]), "the result line must come last:\n%s", transcript)
			for _, want := range tc.also {
				require.Contains(t, transcript, want)
			}
			// The example used the schema it was given, not its default one.
			var n int
			require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE status = 'PUBLISHED'`).Scan(&n))
			committed, err := strconv.Atoi(m[2])
			require.NoError(t, err)
			require.Equal(t, committed, n, "published rows in the test schema")
		})
	}
}

// cleanEnv is the test's environment without the settings that would send
// an example to a real broker: the examples run with their defaults.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case "KAFKA_BROKERS", "PUBSUB_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", "OUTBOX_DATABASE_URL":
			continue
		}
		env = append(env, kv)
	}
	return env
}

func goBinary(t *testing.T) string {
	t.Helper()
	if p := filepath.Join(runtime.GOROOT(), "bin", "go"); fileExists(p) {
		return p
	}
	p, err := exec.LookPath("go")
	require.NoError(t, err, "the go command is needed to build the examples")
	return p
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
