// Package startstop is the start/stop lifecycle of a long-running part of
// the relay, in two kinds:
//
//   - Life, for a part started once (a forwarder's Run loop): a Close that
//     may come before the start, more than once, or from several
//     goroutines, and after the start waits for the run to finish and
//     returns what the run left for it;
//   - Runs, for a part that runs again once a run has ended (cdcrelay's
//     Relay): one run at a time, each under a context that Close cancels;
//     Close, also before the first run, more than once or concurrently,
//     refuses every later run and waits for the active one.
package startstop

import (
	"errors"
	"sync"
)

// Refusals of Start (and of Runs.Hold).
var (
	// ErrClosed: Close was called (before Start for a Life); the part
	// cannot run.
	ErrClosed = errors.New("startstop: closed")
	// ErrStarted: Start of a Life was called before.
	ErrStarted = errors.New("startstop: started already")
	// ErrRunning: Start (or Hold) of Runs while another run is active.
	ErrRunning = errors.New("startstop: a run is active")
)

// Life is one part's lifecycle. Create it with New; the zero Life is not
// usable.
type Life struct {
	mu      sync.Mutex
	started bool
	closed  bool

	stop        chan struct{} // closed by Stop or Close
	stopOnce    sync.Once
	running     chan struct{} // closed by SetRunning
	runningOnce sync.Once
	done        chan struct{} // closed by Finish
	// err is what Finish was given, returned by Close; written before done
	// is closed.
	err error
}

// New returns a Life neither started nor closed.
func New() *Life {
	return &Life{stop: make(chan struct{}), running: make(chan struct{}), done: make(chan struct{})}
}

// Start marks the part started. It refuses with ErrClosed after Close and
// with ErrStarted after an earlier Start. A caller whose Start succeeded
// must call Finish once its run ends.
func (l *Life) Start() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closed:
		return ErrClosed
	case l.started:
		return ErrStarted
	}
	l.started = true
	return nil
}

// Stopping is closed once Stop or Close was called.
func (l *Life) Stopping() <-chan struct{} { return l.stop }

// Stop asks the run to end without waiting for it (the run itself may call
// it). Safe to call more than once.
func (l *Life) Stop() { l.stopOnce.Do(func() { close(l.stop) }) }

// Running is closed by SetRunning: the run passed its start-up checks.
func (l *Life) Running() chan struct{} { return l.running }

// SetRunning closes Running. Safe to call more than once.
func (l *Life) SetRunning() { l.runningOnce.Do(func() { close(l.running) }) }

// Finish ends the run: err (nil for none) is what Close returns, and Done
// is closed. Call it once, after a successful Start.
func (l *Life) Finish(err error) {
	l.err = err
	close(l.done)
}

// Done is closed once Finish was called.
func (l *Life) Done() <-chan struct{} { return l.done }

// Close marks the part closed (a later Start refuses) and stops it. When it
// was started, Close waits for Finish and returns what Finish was given;
// started reports which. Safe to call more than once and concurrently.
func (l *Life) Close() (started bool, err error) {
	l.mu.Lock()
	l.closed = true
	started = l.started
	l.mu.Unlock()
	l.Stop()
	if !started {
		return false, nil
	}
	<-l.done
	return true, l.err
}
