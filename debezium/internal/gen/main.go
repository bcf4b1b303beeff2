// Command gen writes the shipped Debezium connector files
// (debezium/outbox-connector.json and .properties) from debezium.Generate.
// Run it from the repository root (`go run ./debezium/internal/gen`) or via
// `go generate ./debezium`.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/fencedoutbox/watermill-outbox/debezium"
)

func main() {
	dir := flag.String("dir", defaultDir(), "directory of the debezium package")
	flag.Parse()
	files, err := debezium.ShippedFiles()
	if err != nil {
		fmt.Fprintln(os.Stderr, "gen:", err)
		os.Exit(1)
	}
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		path := filepath.Join(*dir, name)
		if err := os.WriteFile(path, files[name], 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "gen:", err)
			os.Exit(1)
		}
		fmt.Println("wrote", path)
	}
}

// defaultDir is "." under go generate (which runs in the package directory)
// and "debezium" from the repository root.
func defaultDir() string {
	if _, err := os.Stat("shipped.go"); err == nil {
		return "."
	}
	return "debezium"
}
