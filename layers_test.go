package outbox_test

import (
	"bytes"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// modulePath is the core module's path; every nested module of go.work sits
// in the directory its path names below it (cdcrelay is .../cdcrelay), so a
// directory of the repository and an import path name each other.
const modulePath = "github.com/fencedoutbox/watermill-outbox"

// layers lists, from the bottom up, which packages of the repository may
// import which. A package's layer is that of the longest prefix listed here
// that it starts with. The non-test code of a package imports only packages
// of a lower layer, or packages of its own top-level directory in the same
// layer (migrations uses migrations/schema, the transports share
// transport/internal/outcome): the imports point down.
//
// Test kits (any package with a testkit element in its path) and commands are
// the top: they may import every library package, and no library package
// imports them (TestNoLibraryPackageImportsATestKit says so on its own).
var layers = []struct {
	name     string
	prefixes []string
}{
	{"runtime helpers", []string{"internal"}},
	{"the schema, the envelope, the relay mode", []string{"migrations", "envelope", "relaymode"}},
	{"the statements that own a table's rows", []string{"fencing", "journal", "retention", "status", "publisher", "debezium"}},
	{"the relays and the inbox", []string{"forwarder", "inbox", "cdcrelay"}},
	{"adapters", []string{"transport", "pgxadapter", "publisher/sqlv3", "publisher/sqlv4", "forwarder/prommetrics", "retention/prommetrics"}},
	{"test kits, commands and examples", []string{"internal/testkit", "transport/internal/testkit", "cmd", "examples", "debezium/internal/gen"}},
	// The root package (errors.go) is below everything; it is "" and
	// handled in layerOf.
}

// layerOf returns the layer of the package in directory dir (slash-separated,
// relative to the repository root), or -1 where no prefix names it.
func layerOf(dir string) int {
	if dir == "." || dir == "" {
		return -1 // the root package: nothing may sit lower, anything may import it
	}
	best, bestLen := -2, -1
	for i, l := range layers {
		for _, p := range l.prefixes {
			if (dir == p || strings.HasPrefix(dir, p+"/")) && len(p) > bestLen {
				best, bestLen = i, len(p)
			}
		}
	}
	return best
}

func isTestKit(dir string) bool {
	for _, el := range strings.Split(dir, "/") {
		if el == "testkit" {
			return true
		}
	}
	return false
}

func isLibrary(dir string) bool {
	return !isTestKit(dir) && layerOf(dir) < len(layers)-1
}

// packageImports reads the non-test .go files of the repository (every
// module of go.work) and returns, per package directory, the directories of
// the repository's packages it imports.
func packageImports(t *testing.T) map[string]map[string]bool {
	t.Helper()
	out := map[string]map[string]bool{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		dir := filepath.ToSlash(filepath.Dir(p))
		if out[dir] == nil {
			out[dir] = map[string]bool{}
		}
		for _, imp := range f.Imports {
			ip, err := strconv.Unquote(imp.Path.Value)
			if err != nil {
				return err
			}
			if ip == modulePath {
				out[dir]["."] = true
			} else if rest, ok := strings.CutPrefix(ip, modulePath+"/"); ok {
				out[dir][rest] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) < 20 {
		t.Fatalf("read only %d package directories; the scan is broken", len(out))
	}
	return out
}

// TestNoLibraryPackageImportsATestKit keeps the test kits (test databases,
// broker fakes, span recorders, the chaos fleet) out of every library
// package's non-test code, so a service importing a library package never
// compiles one in.
func TestNoLibraryPackageImportsATestKit(t *testing.T) {
	imports := packageImports(t)
	libraries := 0
	for dir, deps := range imports {
		if !isLibrary(dir) {
			continue
		}
		libraries++
		for dep := range deps {
			if isTestKit(dep) {
				t.Errorf("library package %s imports the test kit %s (only tests and other test kits may)", dir, dep)
			}
		}
	}
	if libraries < 15 {
		t.Fatalf("found only %d library packages; the scan is broken", libraries)
	}
}

// TestImportsPointDownTheLayers checks the non-test imports of every package
// of the repository against layers.
func TestImportsPointDownTheLayers(t *testing.T) {
	imports := packageImports(t)
	dirs := make([]string, 0, len(imports))
	for dir := range imports {
		dirs = append(dirs, dir)
	}
	sort.Strings(dirs)
	top := func(dir string) string { return strings.SplitN(dir, "/", 2)[0] }
	for _, dir := range dirs {
		from := layerOf(dir)
		if from == -2 {
			t.Errorf("package %s is in no layer: add it to layers in layers_test.go", dir)
			continue
		}
		for dep := range imports[dir] {
			to := layerOf(dep)
			switch {
			case dep == ".":
				// the root package (the typed Error) is below every layer
			case to == -2:
				t.Errorf("%s imports %s, which is in no layer: add it to layers in layers_test.go", dir, dep)
			case to > from:
				t.Errorf("%s (%s) imports %s (%s), a higher layer: imports must point down", dir, layers[from].name, dep, layers[to].name)
			case to == from && top(dir) != top(dep) && from != len(layers)-1:
				t.Errorf("%s imports %s, of the same layer (%s) but another directory: imports must point down", dir, dep, layers[from].name)
			}
		}
	}
	// The walk must have seen the layers it states.
	for _, want := range []string{"internal/pgtext", "envelope", "fencing", "forwarder", "cdcrelay", "transport/amqp", "internal/testkit/testdb", "cmd/outboxctl"} {
		if _, ok := imports[path.Clean(want)]; !ok {
			t.Errorf("the scan did not see package %s", want)
		}
	}
}

// maxFileLines bounds a source file of the repository (its non-test Go
// code, every module, commands and examples included; test kits, which no
// library or command imports, are not held to it): a file that grows past
// it holds more than one role and is split by role (issue 33).
const maxFileLines = 500

func TestNoSourceFileOverFiveHundredLines(t *testing.T) {
	checked := 0
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); p != "." && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules" || name == "testkit") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		checked++
		if n := bytes.Count(data, []byte("\n")); n > maxFileLines {
			t.Errorf("%s: %d lines, more than %d: split it by role", p, n, maxFileLines)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 100 {
		t.Fatalf("only %d source files found: the walk did not start at the repository's root", checked)
	}
}
