package outbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestEveryErrorCodeIsDocumented keeps docs/ERRORS.md complete: every
// exported constant named Code* or Failure* with a string value, in any
// non-test file of the module, must appear in the document. (The Java
// ancestor's documentation drifted from its code; this one cannot.)
func TestEveryErrorCodeIsDocumented(t *testing.T) {
	doc, err := os.ReadFile("docs/ERRORS.md")
	if err != nil {
		t.Fatalf("read docs/ERRORS.md: %v", err)
	}
	codes := map[string]string{} // code -> where declared
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") && path != ".") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, name := range vs.Names {
					if !name.IsExported() || !(strings.HasPrefix(name.Name, "Code") || strings.HasPrefix(name.Name, "Failure")) || i >= len(vs.Values) {
						continue
					}
					lit, ok := vs.Values[i].(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						continue
					}
					v, _ := strconv.Unquote(lit.Value)
					if v != "" && strings.ToUpper(v) == v {
						codes[v] = path + ": " + name.Name
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(codes) < 20 {
		t.Fatalf("found only %d codes; the scan is broken", len(codes))
	}
	for code, where := range codes {
		if !strings.Contains(string(doc), "`"+code+"`") {
			t.Errorf("code %s (%s) is not documented in docs/ERRORS.md", code, where)
		}
	}
}
