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

// TestEveryClassifierCodeIsDocumented covers what the constant scan above
// cannot see: codes a classifier writes as a literal or builds from a literal
// prefix. In every non-test file, the Code of each Result or Verdict
// composite literal (keyed Code: or the second positional element) that is a
// string literal, or a constant of the same file, must appear in
// docs/ERRORS.md as `CODE`; a literal prefix joined with + ("KAFKA_" + name)
// must appear as `PREFIX<`.
func TestEveryClassifierCodeIsDocumented(t *testing.T) {
	doc, err := os.ReadFile("docs/ERRORS.md")
	if err != nil {
		t.Fatalf("read docs/ERRORS.md: %v", err)
	}
	var checked int
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
		consts := map[string]string{}
		for _, decl := range f.Decls {
			if gd, ok := decl.(*ast.GenDecl); ok && gd.Tok == token.CONST {
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, name := range vs.Names {
						if i < len(vs.Values) {
							if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
								consts[name.Name], _ = strconv.Unquote(lit.Value)
							}
						}
					}
				}
			}
		}
		str := func(e ast.Expr) (string, bool) {
			switch e := e.(type) {
			case *ast.BasicLit:
				if e.Kind == token.STRING {
					v, _ := strconv.Unquote(e.Value)
					return v, true
				}
			case *ast.Ident:
				v, ok := consts[e.Name]
				return v, ok
			}
			return "", false
		}
		ast.Inspect(f, func(n ast.Node) bool {
			cl, ok := n.(*ast.CompositeLit)
			if !ok {
				return true
			}
			var typeName string
			switch tt := cl.Type.(type) {
			case *ast.Ident:
				typeName = tt.Name
			case *ast.SelectorExpr:
				typeName = tt.Sel.Name
			}
			if typeName != "Result" && typeName != "Verdict" {
				return true
			}
			var code ast.Expr
			for i, el := range cl.Elts {
				if kv, ok := el.(*ast.KeyValueExpr); ok {
					if k, ok := kv.Key.(*ast.Ident); ok && k.Name == "Code" {
						code = kv.Value
					}
				} else if i == 1 {
					code = el
				}
			}
			if code == nil {
				return true
			}
			if be, ok := code.(*ast.BinaryExpr); ok && be.Op == token.ADD {
				if p, ok := str(be.X); ok {
					checked++
					if !strings.Contains(string(doc), "`"+p+"<") {
						t.Errorf("%s: codes built as %q + ... are not documented in docs/ERRORS.md as `%s<...>`", path, p, p)
					}
				}
				return true
			}
			if v, ok := str(code); ok && v != "" {
				checked++
				if !strings.Contains(string(doc), "`"+v+"`") {
					t.Errorf("%s: classifier code %s is not documented in docs/ERRORS.md", path, v)
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 10 {
		t.Fatalf("checked only %d classifier codes; the scan is broken", checked)
	}
}

// TestEveryFuzzTargetIsListed keeps docs/BAD_INPUT.md's list of fuzz targets
// complete: every Fuzz* function in a test file of the repository is named
// there.
func TestEveryFuzzTargetIsListed(t *testing.T) {
	doc, err := os.ReadFile("docs/BAD_INPUT.md")
	if err != nil {
		t.Fatalf("read docs/BAD_INPUT.md: %v", err)
	}
	var found int
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") && path != ".") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			if fd, ok := decl.(*ast.FuncDecl); ok && fd.Recv == nil && strings.HasPrefix(fd.Name.Name, "Fuzz") {
				found++
				if !strings.Contains(string(doc), "`"+fd.Name.Name+"`") {
					t.Errorf("fuzz target %s (%s) is not listed in docs/BAD_INPUT.md", fd.Name.Name, path)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found == 0 {
		t.Fatal("found no fuzz target; the scan is broken")
	}
}
