package startstop_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/fencedoutbox/watermill-outbox/internal/startstop"
)

func TestStartsOnce(t *testing.T) {
	l := startstop.New()
	if err := l.Start(); err != nil {
		t.Fatalf("first Start: %v", err)
	}
	if err := l.Start(); !errors.Is(err, startstop.ErrStarted) {
		t.Fatalf("second Start: %v, want ErrStarted", err)
	}
	l.Finish(nil)
	if started, err := l.Close(); !started || err != nil {
		t.Fatalf("Close = %v, %v", started, err)
	}
	if err := l.Start(); !errors.Is(err, startstop.ErrClosed) {
		t.Fatalf("Start after Close: %v, want ErrClosed", err)
	}
}

func TestCloseBeforeStartRefusesTheStart(t *testing.T) {
	l := startstop.New()
	if started, err := l.Close(); started || err != nil {
		t.Fatalf("Close = %v, %v", started, err)
	}
	select {
	case <-l.Stopping():
	default:
		t.Fatal("Close did not stop")
	}
	if err := l.Start(); !errors.Is(err, startstop.ErrClosed) {
		t.Fatalf("Start: %v, want ErrClosed", err)
	}
	if started, err := l.Close(); started || err != nil {
		t.Fatalf("second Close = %v, %v", started, err)
	}
}

// Close waits for the run, and every Close returns what the run left.
func TestCloseWaitsForTheRun(t *testing.T) {
	l := startstop.New()
	if err := l.Start(); err != nil {
		t.Fatal(err)
	}
	want := errors.New("drain failed")
	finished := make(chan struct{})
	go func() {
		<-l.Stopping()
		l.SetRunning()
		l.SetRunning()
		close(finished)
		l.Finish(want)
	}()
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			started, err := l.Close()
			select {
			case <-finished:
			default:
				t.Error("Close returned before the run finished")
			}
			if !started || !errors.Is(err, want) {
				t.Errorf("Close = %v, %v", started, err)
			}
		}()
	}
	wg.Wait()
	<-l.Running()
	<-l.Done()
}

// Stop ends the run without waiting, as often as it is called.
func TestStopIsIdempotent(t *testing.T) {
	l := startstop.New()
	l.Stop()
	l.Stop()
	<-l.Stopping()
}
