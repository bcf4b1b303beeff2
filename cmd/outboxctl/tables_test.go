package main

import (
	"database/sql"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder/prommetrics"
	"github.com/fencedoutbox/watermill-outbox/status"
)

// describing is a prometheus.Registerer that keeps what is registered, so
// that every series a component registers is known before any is observed
// (a vector has no series until its first label values).
type describing struct{ cs []prometheus.Collector }

func (d *describing) Register(c prometheus.Collector) error   { d.cs = append(d.cs, c); return nil }
func (d *describing) MustRegister(cs ...prometheus.Collector) { d.cs = append(d.cs, cs...) }
func (d *describing) Unregister(prometheus.Collector) bool    { return false }

var fqName = regexp.MustCompile(`fqName: "([a-z_:]+)"`)

// registeredSeries are the metric names the forwarder's Prometheus metrics
// and the backlog collector register, with their default namespace: what
// `outboxctl relay` (and any service using both) exposes.
func registeredSeries(t *testing.T) []string {
	t.Helper()
	reg := &describing{}
	_, err := prommetrics.New(reg, prommetrics.Options{})
	require.NoError(t, err)
	db, err := sql.Open("postgres", "postgres://unused@127.0.0.1:1/none") // Describe never connects
	require.NoError(t, err)
	defer db.Close()
	c, err := status.NewCollector(db, status.CollectorOptions{})
	require.NoError(t, err)
	reg.MustRegister(c)
	descs := make(chan *prometheus.Desc, 128)
	for _, c := range reg.cs {
		c.Describe(descs)
	}
	close(descs)
	var out []string
	for d := range descs {
		m := fqName.FindStringSubmatch(d.String())
		require.NotNil(t, m, d.String())
		out = append(out, m[1])
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// readmeTable returns the backticked names matching name in the first
// column of the README table under the section heading, until the next
// blank line after the table.
func readmeTable(t *testing.T, readme, heading, header string, name *regexp.Regexp) []string {
	t.Helper()
	i := strings.Index(readme, "\n"+heading+"\n")
	require.Positive(t, i, "README has no section %q", heading)
	j := strings.Index(readme[i:], "\n"+header+"\n")
	require.Positive(t, j, "README's %q has no table headed %q", heading, header)
	var out []string
	for _, l := range strings.Split(readme[i+j+1:], "\n")[2:] {
		if !strings.HasPrefix(l, "|") {
			break
		}
		first := strings.Split(l, "|")[1]
		for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(first, -1) {
			n := name.FindString(m[1])
			require.NotEmpty(t, n, "README table row %q names %q", l, m[1])
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// The README's metrics table lists every series the forwarder and the
// backlog collector register, and nothing else; its alert table lists every
// rule of deploy/prometheus, and nothing else.
func TestREADMEListsEveryMetricAndAlert(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	readme := string(raw)

	listed := readmeTable(t, readme, "## Observability", "| metric | type | labels |", regexp.MustCompile(`^outbox_[a-z_]+`))
	require.Equal(t, registeredSeries(t), slices.Compact(listed),
		"README.md, Observability: the metrics table must list every series prommetrics.New and status.NewCollector register, once")
	require.Len(t, listed, len(slices.Compact(slices.Clone(listed))), "a series is listed twice")

	var rules []string
	for _, f := range []string{"outbox-alerts.yml", "cdc-rules.yml"} {
		for _, n := range alertNames(t, filepath.Join(deployDir, "prometheus", f)) {
			require.True(t, strings.Contains(readme, "| `"+n+"` | "+f+" |"), "README.md's alert table must name %s with its file %s", n, f)
			rules = append(rules, n)
		}
	}
	slices.Sort(rules)
	alerts := readmeTable(t, readme, "## Observability", "| alert | rule file | fires when |", regexp.MustCompile(`^Outbox[A-Za-z]+$`))
	require.Equal(t, rules, alerts, "README.md, Observability: the alert table must list every rule of deploy/prometheus, once")
}
