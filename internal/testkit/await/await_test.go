package await_test

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
)

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	await.Until(t, func() bool { return calls.Add(1) == 3 }, "third call")
	if got := calls.Load(); got != 3 {
		t.Fatalf("Until returned after %d calls, want 3", got)
	}
}

// The bound is the test's deadline less the margin: never before it.
func TestDeadlineIsTheTestsLessTheMargin(t *testing.T) {
	dl, ok := t.Deadline()
	got := await.Deadline(t)
	if ok {
		if !got.Equal(dl.Add(-await.Margin)) {
			t.Fatalf("Deadline = %v, want %v", got, dl.Add(-await.Margin))
		}
		return
	}
	if d := time.Until(got); d < await.NoDeadline-time.Second || d > await.NoDeadline {
		t.Fatalf("Deadline is %v away, want about %v", d, await.NoDeadline)
	}
}

// fakeT has a deadline Margin+50ms away and records Fatalf instead of
// stopping the real test.
type fakeT struct {
	testing.TB
	deadline time.Time
	failed   chan string
}

func (f *fakeT) Helper()                           {}
func (f *fakeT) Deadline() (time.Time, bool)       { return f.deadline, true }
func (f *fakeT) Fatalf(format string, args ...any) { f.failed <- format; runtime.Goexit() }

func TestUntilFailsTheTestAtItsDeadline(t *testing.T) {
	f := &fakeT{TB: t, deadline: time.Now().Add(await.Margin + 50*time.Millisecond), failed: make(chan string, 1)}
	go await.Until(f, func() bool { return false }, "never")
	select {
	case <-f.failed:
	case <-time.After(time.Minute):
		t.Fatal("Until did not fail the test at its deadline")
	}
}

func TestPatienceIsWhatIsLeftUntilTheDeadline(t *testing.T) {
	want := time.Until(await.Deadline(t))
	got := await.Patience(t)
	if got < 20*time.Second || (want > 20*time.Second && (got-want).Abs() > time.Second) {
		t.Fatalf("Patience = %v, want about %v (at least 20 s)", got, want)
	}
}
