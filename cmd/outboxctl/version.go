package main

import (
	"context"
	"fmt"
	"runtime/debug"

	"github.com/spf13/cobra"
)

// buildInfo is what `outboxctl version` prints, read from the binary's
// embedded build information (debug.ReadBuildInfo): no ldflags needed.
type buildInfo struct {
	Module    string `json:"module"`
	Version   string `json:"version"` // module version, "(devel)" for a local build
	Revision  string `json:"revision,omitempty"`
	Time      string `json:"time,omitempty"`
	Modified  bool   `json:"modified"`
	GoVersion string `json:"go_version"`
}

func readBuildInfo() buildInfo {
	var b buildInfo
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return buildInfo{Version: "unknown"}
	}
	b.Module, b.Version, b.GoVersion = bi.Main.Path, bi.Main.Version, bi.GoVersion
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Revision = s.Value
		case "vcs.time":
			b.Time = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		}
	}
	if b.Version == "" {
		b.Version = "(devel)"
	}
	return b
}

func (a *app) versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the build's module version, VCS revision and Go version (no database needed)",
		Args:  cobra.NoArgs,
		RunE: a.runE(func(_ context.Context, _ *cobra.Command, _ []string) error {
			b := readBuildInfo()
			if a.json {
				return a.printJSON(b)
			}
			t := newTable(a.stdout)
			t.row("version", b.Version)
			t.row("module", b.Module)
			t.row("revision", b.Revision)
			t.row("time", b.Time)
			t.row("modified", b.Modified)
			t.row("go", b.GoVersion)
			if err := t.flush(); err != nil {
				return fmt.Errorf("write: %w", err)
			}
			return nil
		}),
	}
}
