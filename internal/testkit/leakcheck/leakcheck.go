// Package leakcheck fails a test binary whose tests leave goroutines running.
// It replaces go.uber.org/goleak in the core module's tests: whatever the
// core's tests import, every service importing the core module sees in its
// module graph, and this check needs no module.
//
// VerifyTestMain runs the tests, then takes goroutine dumps until only the
// expected goroutines are left. Goroutines that are still winding down (a
// pool's connection closed an instant ago) get the time to exit: the dump is
// retaken with a growing pause, up to Timeout in all, and only what is still
// there then is reported.
package leakcheck

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Timeout bounds the wait for goroutines to exit after the tests.
var Timeout = 10 * time.Second

// Option changes what counts as a leak.
type Option func(*config)

type config struct{ ignoreTop []string }

// IgnoreTopFunction ignores goroutines whose topmost frame is in the function
// named fn (as the stack dump names it, e.g.
// "database/sql.(*DB).connectionOpener").
func IgnoreTopFunction(fn string) Option {
	return func(c *config) { c.ignoreTop = append(c.ignoreTop, fn) }
}

// Goroutines that belong to the runtime or the testing package, not to code
// under test.
var builtin = []string{
	"os/signal.signal_recv",
	"os/signal.loop",
	"runtime.ensureSigM",
	"runtime.ReadTrace",
	"runtime/trace.Start.func1",
	"testing.(*F).Fuzz.func1",
	"testing.runFuzzing",
	"testing.(*T).Run", // the test runner itself, when Find runs inside a test
}

// VerifyTestMain is TestMain's body: m.Run, then the leak check when the
// tests passed. It exits the process with the tests' code, or 1 on a leak.
func VerifyTestMain(m *testing.M, opts ...Option) {
	code := m.Run()
	if code == 0 {
		if leaks := Find(opts...); leaks != "" {
			fmt.Fprintf(os.Stderr, "leakcheck: goroutines left running after the tests:\n\n%s\n", leaks)
			code = 1
		}
	}
	os.Exit(code)
}

// Find returns the stacks of the goroutines, other than the caller's and
// the ignored ones, still running after up to Timeout; "" when none are.
func Find(opts ...Option) string {
	var c config
	for _, o := range opts {
		o(&c)
	}
	deadline := time.Now().Add(Timeout)
	pause := time.Millisecond
	for {
		leaks := unexpected(&c)
		if len(leaks) == 0 {
			return ""
		}
		if time.Now().After(deadline) {
			return strings.Join(leaks, "\n\n")
		}
		time.Sleep(pause)
		pause = min(2*pause, 100*time.Millisecond)
	}
}

func unexpected(c *config) []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	blocks := strings.Split(strings.TrimSpace(string(buf)), "\n\n")
	var leaks []string
	for i, b := range blocks {
		if i == 0 { // the caller's goroutine comes first
			continue
		}
		if ignored(topFunction(b), c) {
			continue
		}
		leaks = append(leaks, b)
	}
	return leaks
}

// topFunction is the function of a goroutine's first frame: the line after
// "goroutine N [state]:", up to its argument list.
func topFunction(block string) string {
	lines := strings.SplitN(block, "\n", 3)
	if len(lines) < 2 {
		return ""
	}
	fn := lines[1]
	if i := strings.LastIndex(fn, "("); i > 0 {
		fn = fn[:i]
	}
	return fn
}

func ignored(fn string, c *config) bool {
	for _, s := range builtin {
		if fn == s {
			return true
		}
	}
	for _, s := range c.ignoreTop {
		if fn == s {
			return true
		}
	}
	return false
}
