package startstop

import (
	"context"
	"sync"
)

// Runs is the lifecycle of a part that may run again once its run has ended
// (cdcrelay's Relay): one run at a time, each begun by Start and ended by
// the finish Start returned. Close, which may come before the first run,
// more than once or from several goroutines, refuses every later Start,
// cancels the active run's context and waits for its finish. Unlike Life
// it carries no result: a run returns its own. The zero Runs is ready to
// use; it must not be copied after first use.
type Runs struct {
	mu     sync.Mutex
	closed bool
	active bool // a run (Start) or a hold (Hold) is active
	// cancel and done belong to the active run begun by Start: Close
	// cancels it and waits for done, which its finish closes. Both are nil
	// between runs and during a hold.
	cancel context.CancelFunc
	done   chan struct{}
}

// Start begins a run under runCtx, a context derived from ctx that Close
// cancels. It refuses with ErrClosed after Close and with ErrRunning while
// another run or a hold is active. A caller whose Start succeeded must call
// finish once the run is over, whatever ended it: finish cancels runCtx,
// lets the next Start through and then releases the Closes waiting for the
// run. Calling finish again does nothing.
func (r *Runs) Start(ctx context.Context) (runCtx context.Context, finish func(), err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.refusal(); err != nil {
		return nil, nil, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	r.active, r.cancel, r.done = true, cancel, done
	var once sync.Once
	return runCtx, func() {
		once.Do(func() {
			cancel()
			r.end()
			close(done)
		})
	}, nil
}

// Hold begins a run that Close neither cancels nor waits for: work that
// ends with its own context (cdcrelay's handover) but must not overlap a
// run. Start refuses with ErrRunning until release is called. Hold refuses
// as Start does. Calling release again does nothing.
func (r *Runs) Hold() (release func(), err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.refusal(); err != nil {
		return nil, err
	}
	r.active = true
	var once sync.Once
	return func() { once.Do(r.end) }, nil
}

// refusal is why a run cannot begin now, or nil. r.mu is held.
func (r *Runs) refusal() error {
	switch {
	case r.closed:
		return ErrClosed
	case r.active:
		return ErrRunning
	}
	return nil
}

// end marks the active run or hold over.
func (r *Runs) end() {
	r.mu.Lock()
	r.active, r.cancel, r.done = false, nil, nil
	r.mu.Unlock()
}

// Close marks the part closed (every later Start and Hold refuses with
// ErrClosed), cancels the context of the active run, if Start began one,
// and waits for its finish. A hold is neither cancelled nor waited for.
// Safe to call before any run, more than once and concurrently: every
// Close returns once the run it found has finished.
func (r *Runs) Close() {
	r.mu.Lock()
	r.closed = true
	cancel, done := r.cancel, r.done
	r.mu.Unlock()
	if done != nil {
		cancel()
		<-done
	}
}
