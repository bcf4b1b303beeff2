package relaymode_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestRelayModeRulesNeedNoDebezium keeps the relay-mode rules importable
// without the Debezium configuration package (issue 18): relaymode itself and
// every package of the core that asks "may I run?" (the polling relay,
// retention, status) must not have debezium among their dependencies.
func TestRelayModeRulesNeedNoDebezium(t *testing.T) {
	const mod = "github.com/fencedoutbox/watermill-outbox/"
	pkgs := []string{mod + "relaymode", mod + "forwarder", mod + "retention", mod + "status"}
	for _, p := range pkgs {
		out, err := exec.Command("go", "list", "-deps", p).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", p, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			if strings.HasSuffix(dep, "/debezium") || strings.Contains(dep, "/debezium/") {
				t.Errorf("%s depends on %s: the relay-mode rules must stay importable without the Debezium package", p, dep)
			}
		}
	}
}
