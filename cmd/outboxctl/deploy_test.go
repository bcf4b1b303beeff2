package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

const deployDir = "../../deploy"

// relayFlagSet is a fresh relay command, its flags registered.
func relayFlagSet(t *testing.T) *cobra.Command {
	t.Helper()
	a := &app{getenv: func(string) string { return "" }}
	root := a.rootCommand()
	cmd, _, err := root.Find([]string{"relay"})
	require.NoError(t, err)
	return cmd
}

// checkRelaySettings requires that every variable in env names a relay flag
// (or is the global OUTBOX_DATABASE_URL) and parses as that flag's value,
// that every flag in args is a relay flag, and returns the drain timeout the
// settings give.
func checkRelaySettings(t *testing.T, where string, env map[string]string, args []string) time.Duration {
	t.Helper()
	cmd := relayFlagSet(t)
	byEnv := map[string]*pflag.Flag{}
	cmd.Flags().VisitAll(func(f *pflag.Flag) { byEnv[envName(f.Name)] = f })
	for name := range env {
		if name == "OUTBOX_DATABASE_URL" {
			continue
		}
		require.Contains(t, byEnv, name, "%s: %s names no relay flag", where, name)
	}
	require.Contains(t, env, "OUTBOX_DATABASE_URL", "%s: no database URL", where)
	require.NoError(t, cmd.Flags().Parse(args), "%s: flags %q", where, args)
	require.NoError(t, bindEnv(cmd, func(k string) string { return env[k] }), where)

	drain, err := cmd.Flags().GetDuration("drain-timeout")
	require.NoError(t, err)
	if drain == 0 {
		drain, err = cmd.Flags().GetDuration("publish-timeout")
		require.NoError(t, err)
	}
	// The settings make a valid forwarder configuration.
	cfg := forwarder.Config{}
	for flag, into := range map[string]*time.Duration{"lease": &cfg.LeaseDuration, "publish-timeout": &cfg.PublishTimeout,
		"drain-timeout": &cfg.DrainTimeout, "heartbeat-interval": &cfg.HeartbeatInterval} {
		*into, err = cmd.Flags().GetDuration(flag)
		require.NoError(t, err)
	}
	require.NoError(t, cfg.Validate(), where)
	to, _ := cmd.Flags().GetString("to")
	require.Contains(t, sinks, to, "%s: --to %q", where, to)
	return drain
}

func TestDeployKubernetesMatchesFlags(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(filepath.Join(deployDir, "kubernetes", "relay-deployment.yaml"))
	require.NoError(t, err)
	var d struct {
		Kind string
		Spec struct {
			Template struct {
				Spec struct {
					TerminationGracePeriodSeconds int `yaml:"terminationGracePeriodSeconds"`
					Containers                    []struct {
						Command []string
						Args    []string
						Env     []struct {
							Name      string
							Value     *string
							ValueFrom map[string]any `yaml:"valueFrom"`
						}
						Ports []struct {
							Name          string
							ContainerPort int `yaml:"containerPort"`
						}
						LivenessProbe struct {
							HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
						} `yaml:"livenessProbe"`
						ReadinessProbe struct {
							HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
						} `yaml:"readinessProbe"`
					}
				}
			}
		}
	}
	require.NoError(t, yaml.Unmarshal(raw, &d))
	require.Equal(t, "Deployment", d.Kind)
	require.Len(t, d.Spec.Template.Spec.Containers, 1)
	c := d.Spec.Template.Spec.Containers[0]
	require.Equal(t, []string{"outboxctl", "relay"}, c.Command)

	env := map[string]string{}
	for _, e := range c.Env {
		if !strings.HasPrefix(e.Name, "OUTBOX_") {
			continue
		}
		switch {
		case e.Value != nil:
			// Kubernetes expands $(VAR) from earlier variables.
			env[e.Name] = strings.ReplaceAll(*e.Value, "$(POD_IP)", "10.0.0.7")
		case e.ValueFrom != nil:
			env[e.Name] = "from-" + e.Name // a secret or a field: any string
		}
	}
	env["OUTBOX_DATABASE_URL"] = "postgres://u@db/app" // a secretKeyRef in the manifest
	drain := checkRelaySettings(t, "relay-deployment.yaml", env, c.Args)

	// The probes reach /healthz and /readyz on the metrics port, which is the
	// port OUTBOX_METRICS_ADDR binds.
	require.Len(t, c.Ports, 1)
	require.Equal(t, "/healthz", c.LivenessProbe.HTTPGet.Path)
	require.Equal(t, "/readyz", c.ReadinessProbe.HTTPGet.Path)
	require.Equal(t, c.Ports[0].Name, c.LivenessProbe.HTTPGet.Port)
	require.Equal(t, c.Ports[0].Name, c.ReadinessProbe.HTTPGet.Port)
	require.True(t, strings.HasSuffix(env["OUTBOX_METRICS_ADDR"], ":"+strconv.Itoa(c.Ports[0].ContainerPort)), env["OUTBOX_METRICS_ADDR"])

	// The grace period is what the relay says its stop may take with these
	// settings (`outboxctl relay --print-grace`, run as the pod would).
	require.Positive(t, drain)
	require.Equal(t, shippedGrace(t, env, c.Args), d.Spec.Template.Spec.TerminationGracePeriodSeconds,
		"terminationGracePeriodSeconds must be what `outboxctl relay --print-grace` prints with the manifest's settings")
}

// shippedGrace runs `outboxctl relay --print-grace` with env as its only
// environment and args after it, and returns the seconds it prints.
func shippedGrace(t *testing.T, env map[string]string, args []string) int {
	t.Helper()
	var list []string
	for k, v := range env {
		list = append(list, k+"="+v)
	}
	r := cli(t, list, append([]string{"relay", "--print-grace"}, args...)...)
	requireCode(t, r, 0)
	n, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	require.NoError(t, err, r.stdout)
	return n
}

func TestDeploySystemdMatchesFlags(t *testing.T) {
	t.Parallel()
	unit := readUnit(t, filepath.Join(deployDir, "systemd", "outbox-relay.service"))
	svc := unit["Service"]
	require.Equal(t, "SIGTERM", svc["KillSignal"][0])
	exec := strings.Fields(svc["ExecStart"][0])
	require.GreaterOrEqual(t, len(exec), 2)
	require.Equal(t, "outboxctl", filepath.Base(exec[0]))
	require.Equal(t, "relay", exec[1])
	require.Contains(t, strings.Fields(svc["RestartPreventExitStatus"][0]), strconv.Itoa(ExitUsage))
	require.Contains(t, strings.Fields(svc["RestartPreventExitStatus"][0]), strconv.Itoa(ExitRefused))

	// The EnvironmentFile is the shipped relay.env.
	require.Equal(t, "relay.env", filepath.Base(svc["EnvironmentFile"][0]))
	env := readEnvFile(t, filepath.Join(deployDir, "systemd", "relay.env"))
	drain := checkRelaySettings(t, "outbox-relay.service", env, exec[2:])

	stop, err := strconv.Atoi(svc["TimeoutStopSec"][0])
	require.NoError(t, err, "TimeoutStopSec is a number of seconds")
	require.Positive(t, drain)
	require.Equal(t, shippedGrace(t, env, exec[2:]), stop,
		"TimeoutStopSec must be what `outboxctl relay --print-grace` prints with the unit's settings")
	// Examples bind the operations listener to loopback on a host.
	require.True(t, strings.HasPrefix(env["OUTBOX_METRICS_ADDR"], "127.0.0.1:"), env["OUTBOX_METRICS_ADDR"])
}

// readUnit parses a systemd unit: section -> key -> values.
func readUnit(t *testing.T, path string) map[string]map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	out := map[string]map[string][]string{}
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		switch {
		case l == "" || strings.HasPrefix(l, "#") || strings.HasPrefix(l, ";"):
		case strings.HasPrefix(l, "[") && strings.HasSuffix(l, "]"):
			section = l[1 : len(l)-1]
			out[section] = map[string][]string{}
		default:
			k, v, ok := strings.Cut(l, "=")
			require.True(t, ok, "%s: %q", path, l)
			out[section][strings.TrimSpace(k)] = append(out[section][strings.TrimSpace(k)], strings.TrimSpace(v))
		}
	}
	require.NoError(t, sc.Err())
	return out
}

// readEnvFile parses a systemd EnvironmentFile (KEY=value lines, # comments).
func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	env := map[string]string{}
	for _, l := range strings.Split(string(raw), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		k, v, ok := strings.Cut(l, "=")
		require.True(t, ok, "%s: %q", path, l)
		env[k] = v
	}
	return env
}

var metricRe = regexp.MustCompile(`\boutbox_[a-z_]+`)

// exposedMetrics runs a relay on a fresh schema with a published row and a
// parked one, then cuts its downstream (--to log on a stdout nobody reads
// any more) until a breaker opens, and returns the metric family names its
// /metrics serves: those of an outage included.
func exposedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	s := newSchema(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "m-1", Destination: "orders", Payload: []byte("x")})
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "f-1", Destination: "orders", Payload: []byte("x"), Status: envelope.StatusFailed, LastFailureCode: "X"})
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	cmd := exec.Command(binary, "--database-url", s.URL, "relay", "--to", "log", "--metrics-addr", "127.0.0.1:0",
		"--poll-interval", "50ms", "--max-poll-interval", "200ms", "--publish-timeout", "300ms", "--lease", "2s")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	cmd.Stdout = w
	stderr := &syncWriter{}
	cmd.Stderr = stderr
	require.NoError(t, cmd.Start())
	require.NoError(t, w.Close())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	var url string
	require.Eventually(t, func() bool {
		url = regexp.MustCompile(`http://[^\s"]+/metrics`).FindString(stderr.String())
		return url != ""
	}, 60*time.Second, 20*time.Millisecond, "stderr:\n%s", stderr.String())
	waitStatus(t, s, stderr, "m-1", "PUBLISHED")

	// The outage: lines larger than the pipe holds, which nobody reads.
	big := []byte(strings.Repeat("y", 64<<10))
	for i := range 8 {
		testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "big-" + strconv.Itoa(i), Destination: "orders", Payload: big})
	}
	names := map[string]bool{}
	require.Eventually(t, func() bool {
		_, body := get(t, url)
		for _, l := range strings.Split(body, "\n") {
			if strings.HasPrefix(l, "# TYPE ") {
				names[strings.Fields(l)[2]] = true
			}
		}
		return names["outbox_forwarder_messages_total"] && names["outbox_oldest_pending_age_seconds"] &&
			strings.Contains(body, `outbox_forwarder_breaker_open{destination="orders"} 1`)
	}, 60*time.Second, 50*time.Millisecond, "no breaker opened\nstderr:\n%s", stderr.String())
	return names
}

// requireKnownMetrics fails for any outbox_* name in text that the relay
// does not expose (histogram series are matched by their family).
func requireKnownMetrics(t *testing.T, where, text string, exposed map[string]bool) {
	t.Helper()
	found := 0
	for _, m := range metricRe.FindAllString(text, -1) {
		family := m
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if !exposed[family] && strings.HasSuffix(family, suffix) && exposed[strings.TrimSuffix(family, suffix)] {
				family = strings.TrimSuffix(family, suffix)
			}
		}
		require.True(t, exposed[family], "%s: metric %s is not exposed by the relay (exposed: %v)", where, m, keys(exposed))
		found++
	}
	require.Positive(t, found, "%s names no metric", where)
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		if strings.HasPrefix(k, "outbox_") {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

// The alert rules pass `promtool check rules` and their unit tests
// (`promtool test rules`); the rules and the dashboard name only metrics the
// relay exposes. promtool comes from scripts/ensure-promtool.sh, which
// installs Debian's prometheus package when it can; only where it cannot is
// the promtool part skipped, saying so.
func TestPrometheusRulesAndDashboard(t *testing.T) {
	t.Parallel()
	rules, err := os.ReadFile(filepath.Join(deployDir, "prometheus", "outbox-alerts.yml"))
	require.NoError(t, err)
	dashRaw, err := os.ReadFile(filepath.Join(deployDir, "grafana", "outbox-dashboard.json"))
	require.NoError(t, err)
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	require.NoError(t, json.Unmarshal(dashRaw, &dash))
	require.NotEmpty(t, dash.Panels)
	var exprs strings.Builder
	for _, p := range dash.Panels {
		require.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
		for _, tg := range p.Targets {
			exprs.WriteString(tg.Expr + "\n")
		}
	}
	// Every rule of both files has a unit test in which it fires.
	for _, f := range []string{"outbox-alerts", "cdc-rules"} {
		names := alertNames(t, filepath.Join(deployDir, "prometheus", f+".yml"))
		require.NotEmpty(t, names, f)
		firing := firingInTests(t, filepath.Join(deployDir, "prometheus", f+".test.yml"))
		for _, n := range names {
			require.True(t, firing[n], "%s.yml: alert %s fires in no test of %s.test.yml", f, n, f)
		}
	}

	exposed := exposedMetrics(t)
	requireKnownMetrics(t, "outbox-alerts.yml", string(rules), exposed)
	requireKnownMetrics(t, "outbox-dashboard.json", exprs.String(), exposed)

	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	ensure := exec.CommandContext(ctx, "../../scripts/ensure-promtool.sh")
	var out, errb bytes.Buffer
	ensure.Stdout, ensure.Stderr = &out, &errb
	if err := ensure.Run(); err != nil {
		t.Skipf("promtool is not available, so the alert rules were not checked with promtool (scripts/ensure-promtool.sh: %v): %s", err, errb.String())
	}
	promtool := strings.TrimSpace(out.String())
	for _, args := range [][]string{{"check", "rules", "outbox-alerts.yml"}, {"test", "rules", "outbox-alerts.test.yml"}} {
		cmd := exec.CommandContext(ctx, promtool, args...)
		cmd.Dir = filepath.Join(deployDir, "prometheus")
		res, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), res)
		require.Contains(t, string(res), "SUCCESS")
	}
}

// alertNames are the alert rules of a Prometheus rule file, in order.
func alertNames(t *testing.T, path string) []string {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var f struct {
		Groups []struct {
			Rules []struct{ Alert, Record string }
		}
	}
	require.NoError(t, yaml.Unmarshal(raw, &f), path)
	var out []string
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Alert, "%s: a recording rule (%s); the tables list alerts only", path, r.Record)
			out = append(out, r.Alert)
		}
	}
	return out
}

// firingInTests are the alerts a promtool test file expects to fire at
// least once.
func firingInTests(t *testing.T, path string) map[string]bool {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var f struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string
				ExpAlerts []map[string]any `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		}
	}
	require.NoError(t, yaml.Unmarshal(raw, &f), path)
	out := map[string]bool{}
	for _, tc := range f.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				out[a.Alertname] = true
			}
		}
	}
	return out
}
