package outbox_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDocNamesEveryPackage keeps the package list in doc.go and the README's
// package table complete: every top-level directory that holds Go code
// (besides cmd, examples and internal, which are not importable products) is
// named in both.
func TestDocNamesEveryPackage(t *testing.T) {
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	skip := map[string]bool{"cmd": true, "examples": true, "internal": true}
	checked := 0
	for _, e := range entries {
		if !e.IsDir() || skip[e.Name()] || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		hasGo := false
		_ = filepath.WalkDir(e.Name(), func(path string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() && strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
				hasGo = true
				return filepath.SkipAll
			}
			return nil
		})
		if !hasGo {
			continue
		}
		checked++
		if !strings.Contains(string(doc), "//   - "+e.Name()+":") {
			t.Errorf("doc.go does not list package %s", e.Name())
		}
		if !strings.Contains(string(readme), "| [`"+e.Name()) {
			t.Errorf("the README's package table does not list package %s", e.Name())
		}
	}
	if checked < 8 {
		t.Fatalf("found only %d package directories; the scan is broken", checked)
	}
}
