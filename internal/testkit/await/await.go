// Package await waits in tests for something to happen, bounded by the
// test's own deadline rather than a guess at how long the machine needs.
//
// A fixed bound (require.Eventually's "within 10 s") turns a busy CI
// machine into a failed test: the thing still happens, later. Until polls
// until the condition holds and gives up only when the test is about to run
// out of time (go test -timeout), leaving a margin for the cleanups and the
// failure report, or after [NoDeadline] for a test run without a timeout.
package await

import (
	"fmt"
	"testing"
	"time"
)

// Poll is how often Until checks its condition.
const Poll = 5 * time.Millisecond

// Margin is the time Until leaves before the test's deadline: enough for
// the test's cleanups (relays stopping, schemas dropped, throwaway clusters
// stopped) and its report.
const Margin = time.Minute

// NoDeadline bounds the wait of a test run without -timeout.
const NoDeadline = 5 * time.Minute

// Until calls cond every Poll, in the test's goroutine (cond may call
// t.Fatal), until it returns true. It fails the test with what when the
// test's deadline less Margin passes first.
func Until(t testing.TB, cond func() bool, what string, args ...any) {
	t.Helper()
	giveUp := Deadline(t)
	began := time.Now()
	for !cond() {
		if time.Now().After(giveUp) {
			t.Fatalf("await: %s: not so after %s (the test's deadline is near)", fmt.Sprintf(what, args...), time.Since(began).Round(time.Millisecond))
		}
		time.Sleep(Poll)
	}
}

// Deadline is when a wait of t gives up: t's deadline less Margin, or
// NoDeadline from now.
func Deadline(t testing.TB) time.Time {
	giveUp := time.Now().Add(NoDeadline)
	if d, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if dl, ok := d.Deadline(); ok {
			giveUp = dl.Add(-Margin)
		}
	}
	return giveUp
}

// Patience is how long a wait of t may still take, for waits that take a
// duration (a select on a channel, require.Eventually): until Deadline, and
// at least 20 s, so a test already past it still waits a little before it
// reports the wait as failed.
func Patience(t testing.TB) time.Duration {
	return max(time.Until(Deadline(t)), 20*time.Second)
}
