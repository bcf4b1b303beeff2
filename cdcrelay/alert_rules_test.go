package cdcrelay_test

import (
	"bytes"
	"database/sql"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/status"
)

// TestCDCAlertRules checks deploy/prometheus/cdc-rules.yml with promtool
// (check rules, and the unit tests in cdc-rules.test.yml), and that every
// metric the rules use is one the status collector exports.
func TestCDCAlertRules(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	dir := filepath.Join(root, "deploy", "prometheus")

	rules, err := os.ReadFile(filepath.Join(dir, "cdc-rules.yml"))
	require.NoError(t, err)
	db, err := sql.Open("postgres", "postgres://unused@127.0.0.1:1/none") // Describe never connects
	require.NoError(t, err)
	defer db.Close()
	c, err := status.NewCollector(db, status.CollectorOptions{})
	require.NoError(t, err)
	descs := make(chan *prometheus.Desc, 64)
	c.Describe(descs)
	close(descs)
	exported := map[string]bool{}
	name := regexp.MustCompile(`fqName: "([a-z_]+)"`)
	for d := range descs {
		exported[name.FindStringSubmatch(d.String())[1]] = true
	}
	var used []string
	for _, line := range strings.Split(string(rules), "\n") {
		if _, expr, ok := strings.Cut(line, "expr:"); ok {
			used = append(used, regexp.MustCompile(`\boutbox_[a-z_]+`).FindAllString(expr, -1)...)
		}
	}
	require.Len(t, used, 6, "one metric per rule")
	for _, m := range used {
		require.True(t, exported[m], "the rules use %s, which the status collector does not export", m)
	}

	var out bytes.Buffer
	find := exec.Command(filepath.Join(root, "scripts", "ensure-promtool.sh"))
	find.Stdout, find.Stderr = &out, os.Stderr
	if err := find.Run(); err != nil {
		t.Skipf("promtool is not available and could not be installed (scripts/ensure-promtool.sh: %v); the alert rules are not checked", err)
	}
	promtool := strings.TrimSpace(out.String())
	for _, args := range [][]string{{"check", "rules", "cdc-rules.yml"}, {"test", "rules", "cdc-rules.test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		res, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), res)
		require.Contains(t, string(res), "SUCCESS", "promtool %s:\n%s", strings.Join(args, " "), res)
	}
}
