package startstop_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/internal/startstop"
)

// within fails the test when ch is not closed within a generous bound: a
// guard against a hang, never a wait the test relies on.
func within(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: not within 10s", what)
	}
}

func isOpen(ctx context.Context) bool { return ctx.Err() == nil }

// A run that ended, cleanly or not, lets the next one start, under a fresh
// context; the ended run's context is cancelled.
func TestRunsRestartAfterARunEnded(t *testing.T) {
	var r startstop.Runs
	parent := context.Background()
	var prev context.Context
	for i := range 3 {
		ctx, finish, err := r.Start(parent)
		if err != nil {
			t.Fatalf("Start %d: %v", i, err)
		}
		if !isOpen(ctx) {
			t.Fatalf("run %d starts cancelled: %v", i, ctx.Err())
		}
		if prev != nil && !errors.Is(prev.Err(), context.Canceled) {
			t.Fatalf("run %d's context after its finish: %v, want Canceled", i-1, prev.Err())
		}
		finish()
		if !errors.Is(ctx.Err(), context.Canceled) {
			t.Fatalf("run %d's context after finish: %v, want Canceled", i, ctx.Err())
		}
		prev = ctx
	}
	if !isOpen(parent) {
		t.Fatal("finish cancelled the caller's context")
	}
	// A hold ends like a run.
	release, err := r.Hold()
	if err != nil {
		t.Fatalf("Hold: %v", err)
	}
	release()
	_, finish, err := r.Start(parent)
	if err != nil {
		t.Fatalf("Start after a hold: %v", err)
	}
	finish()
}

// While a run or a hold is active, Start and Hold refuse with ErrRunning,
// and the refusal leaves the active run alone.
func TestRunsRefusesAStartWhileRunning(t *testing.T) {
	var r startstop.Runs
	ctx, finish, err := r.Start(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Start(context.Background()); !errors.Is(err, startstop.ErrRunning) {
		t.Fatalf("Start while running: %v, want ErrRunning", err)
	}
	if _, err := r.Hold(); !errors.Is(err, startstop.ErrRunning) {
		t.Fatalf("Hold while running: %v, want ErrRunning", err)
	}
	if !isOpen(ctx) {
		t.Fatalf("a refused Start cancelled the active run: %v", ctx.Err())
	}
	finish()

	release, err := r.Hold()
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Start(context.Background()); !errors.Is(err, startstop.ErrRunning) {
		t.Fatalf("Start while held: %v, want ErrRunning", err)
	}
	if _, err := r.Hold(); !errors.Is(err, startstop.ErrRunning) {
		t.Fatalf("Hold while held: %v, want ErrRunning", err)
	}
	release()
}

// Of Starts racing, exactly one begins a run.
func TestRunsOneOfConcurrentStarts(t *testing.T) {
	var r startstop.Runs
	var began, refused atomic.Int32
	finishes := make(chan func(), 8) // called once every Start returned
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, finish, err := r.Start(context.Background())
			switch {
			case err == nil:
				began.Add(1)
				finishes <- finish
			case errors.Is(err, startstop.ErrRunning):
				refused.Add(1)
			default:
				t.Errorf("Start: %v", err)
			}
		}()
	}
	wg.Wait()
	close(finishes)
	for finish := range finishes {
		finish()
	}
	if began.Load() != 1 || refused.Load() != 7 {
		t.Fatalf("%d began, %d refused; want 1 and 7", began.Load(), refused.Load())
	}
}

// A finish called again, after the next run began, does not end that run.
func TestRunsFinishTwiceEndsOnlyItsRun(t *testing.T) {
	var r startstop.Runs
	_, first, err := r.Start(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	first()
	ctx, second, err := r.Start(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	first()
	if !isOpen(ctx) {
		t.Fatalf("the first run's finish cancelled the second run: %v", ctx.Err())
	}
	if _, _, err := r.Start(context.Background()); !errors.Is(err, startstop.ErrRunning) {
		t.Fatalf("Start during the second run: %v, want ErrRunning", err)
	}
	second()
	second()
}

// Close cancels the active run's context (not the caller's) and returns
// only once the run has finished; then no run starts.
func TestRunsCloseCancelsAndWaits(t *testing.T) {
	var r startstop.Runs
	parent := context.Background()
	ctx, finish, err := r.Start(parent)
	if err != nil {
		t.Fatal(err)
	}
	cancelled, proceed := make(chan struct{}), make(chan struct{})
	var finished atomic.Bool
	go func() {
		<-ctx.Done()
		close(cancelled)
		<-proceed // Close is called and must still be waiting
		finished.Store(true)
		finish()
	}()
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		r.Close()
		if !finished.Load() {
			t.Error("Close returned before the run finished")
		}
	}()
	within(t, cancelled, "Close cancelling the run's context")
	if !errors.Is(ctx.Err(), context.Canceled) {
		t.Fatalf("run context: %v, want Canceled", ctx.Err())
	}
	if !isOpen(parent) {
		t.Fatal("Close cancelled the caller's context")
	}
	select {
	case <-closed:
		t.Fatal("Close returned before the run finished")
	default:
	}
	close(proceed)
	within(t, closed, "Close after the run finished")

	if _, _, err := r.Start(parent); !errors.Is(err, startstop.ErrClosed) {
		t.Fatalf("Start after Close: %v, want ErrClosed", err)
	}
	if _, err := r.Hold(); !errors.Is(err, startstop.ErrClosed) {
		t.Fatalf("Hold after Close: %v, want ErrClosed", err)
	}
}

// A Close before any run refuses every later Start and Hold; Close again
// is fine.
func TestRunsCloseBeforeAnyRun(t *testing.T) {
	var r startstop.Runs
	r.Close()
	for i := range 2 {
		if _, _, err := r.Start(context.Background()); !errors.Is(err, startstop.ErrClosed) {
			t.Fatalf("Start %d after Close: %v, want ErrClosed", i, err)
		}
		if _, err := r.Hold(); !errors.Is(err, startstop.ErrClosed) {
			t.Fatalf("Hold %d after Close: %v, want ErrClosed", i, err)
		}
	}
	r.Close()
}

// Every one of concurrent Closes cancels the run and returns once it has
// finished; a Close after that returns at once.
func TestRunsConcurrentCloses(t *testing.T) {
	var r startstop.Runs
	ctx, finish, err := r.Start(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var finished atomic.Bool
	go func() {
		<-ctx.Done()
		finished.Store(true)
		finish()
	}()
	closed := make(chan struct{})
	var wg sync.WaitGroup
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.Close()
			if !finished.Load() {
				t.Error("a Close returned before the run finished")
			}
		}()
	}
	go func() { wg.Wait(); close(closed) }()
	within(t, closed, "concurrent Closes")
	r.Close()
	if _, _, err := r.Start(context.Background()); !errors.Is(err, startstop.ErrClosed) {
		t.Fatalf("Start after Close: %v, want ErrClosed", err)
	}
}

// Close neither cancels nor waits for a hold; the hold's release is still
// needed, and no run starts after it.
func TestRunsCloseLeavesAHold(t *testing.T) {
	var r startstop.Runs
	release, err := r.Hold()
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	within(t, closed, "Close during a hold")
	if _, _, err := r.Start(context.Background()); !errors.Is(err, startstop.ErrClosed) {
		t.Fatalf("Start after Close during a hold: %v, want ErrClosed", err)
	}
	release()
	release()
	if _, _, err := r.Start(context.Background()); !errors.Is(err, startstop.ErrClosed) {
		t.Fatalf("Start after the hold: %v, want ErrClosed", err)
	}
}
