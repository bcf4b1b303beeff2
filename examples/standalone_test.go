package examples_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Each example builds as a program of its own when copied out of the
// repository: its directory alone, in a new module that requires the
// outbox's modules (a replace to this checkout stands in for a published
// version), outside the workspace. An example that used a package of the
// repository's internal/ tree, or a file of another example, fails here.
func TestExamplesBuildWhenCopiedOut(t *testing.T) {
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	goMod, err := os.ReadFile("go.mod")
	require.NoError(t, err)
	goSum, err := os.ReadFile("go.sum")
	require.NoError(t, err)
	// The module's requirements, with the replaces made absolute.
	mod := regexp.MustCompile(`(?m)^module .*$`).ReplaceAllString(string(goMod), "module example.com/copied")
	mod = regexp.MustCompile(`(?m)=> \.\./?(\S*)$`).ReplaceAllStringFunc(mod, func(s string) string {
		rel := strings.TrimPrefix(strings.TrimPrefix(s, "=> .."), "/")
		return "=> " + filepath.Join(root, rel)
	})
	goBin := goBinary(t)
	for _, dir := range []string{"orders", "router-migration", "legacy-sql", "kafka", "pgx"} {
		t.Run(dir, func(t *testing.T) {
			t.Parallel()
			out := t.TempDir()
			entries, err := os.ReadDir(dir)
			require.NoError(t, err)
			for _, e := range entries {
				if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") {
					continue
				}
				b, err := os.ReadFile(filepath.Join(dir, e.Name()))
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(filepath.Join(out, e.Name()), b, 0o644))
			}
			require.NoError(t, os.WriteFile(filepath.Join(out, "go.mod"), []byte(mod), 0o644))
			require.NoError(t, os.WriteFile(filepath.Join(out, "go.sum"), goSum, 0o644))
			build := exec.Command(goBin, "build", "-o", filepath.Join(out, "bin"), ".")
			build.Dir = out
			build.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
			b, err := build.CombinedOutput()
			require.NoError(t, err, "%s copied out does not build:\n%s", dir, b)
		})
	}
}
