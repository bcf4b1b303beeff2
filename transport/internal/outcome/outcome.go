// Package outcome holds the rule every transport classifier shares: a
// publish whose context ended first is ambiguous. Classifiers return
// forwarder's verdicts directly (forwarder.Verdict, forwarder.Outcome): the
// forwarder's vocabulary is the only one, so there is nothing to translate.
package outcome

import (
	"context"
	"errors"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Codes every classifier writes for a publish whose context ended first.
const (
	CodeContextDeadlineExceeded = "CONTEXT_DEADLINE_EXCEEDED"
	CodeContextCanceled         = "CONTEXT_CANCELED"
)

// Context reports the verdict for cancellation and deadlines. They are
// always ambiguous: the request may have reached the broker before the
// caller stopped waiting for its answer.
func Context(err error) (forwarder.Verdict, bool) {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeContextDeadlineExceeded}, true
	case errors.Is(err, context.Canceled):
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeContextCanceled}, true
	}
	return forwarder.Verdict{}, false
}
