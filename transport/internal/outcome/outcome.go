// Package outcome holds what every transport classifier shares: the context
// rule and the translation of a transport's verdict into the forwarder's.
package outcome

import (
	"context"
	"errors"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Kind is a classifier's decision before it becomes a forwarder verdict.
type Kind int

// The outcomes a publish can have.
const (
	Confirmed   Kind = iota // the broker acknowledged the message
	Rejected                // the broker refused it for good: retrying the same bytes cannot succeed
	Ambiguous               // we do not know whether the broker has it
	Unavailable             // the broker as a whole is unreachable and did not take it: no attempt is spent
)

// Result is a decision with the stable code stored in last_failure_code.
type Result struct {
	Kind Kind
	Code string
}

// Codes every classifier writes for a publish whose context ended first.
const (
	CodeContextDeadlineExceeded = "CONTEXT_DEADLINE_EXCEEDED"
	CodeContextCanceled         = "CONTEXT_CANCELED"
)

// Context reports the verdict for cancellation and deadlines. They are
// always ambiguous: the request may have reached the broker before the
// caller stopped waiting for its answer.
func Context(err error) (Result, bool) {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return Result{Ambiguous, CodeContextDeadlineExceeded}, true
	case errors.Is(err, context.Canceled):
		return Result{Ambiguous, CodeContextCanceled}, true
	}
	return Result{}, false
}

// Verdict translates r into the forwarder's verdict. An unknown Kind maps to
// the zero Outcome, which the forwarder refuses loudly rather than guessing.
func (r Result) Verdict() forwarder.Verdict {
	switch r.Kind {
	case Confirmed:
		return forwarder.Verdict{Outcome: forwarder.Confirmed}
	case Rejected:
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: r.Code}
	case Ambiguous:
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: r.Code}
	case Unavailable:
		return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: r.Code}
	}
	return forwarder.Verdict{Code: r.Code}
}
