// Package classifytest checks a transport's classifier against the failure
// codes docs/ERRORS.md documents for it. Each case is checked on the error
// as the client library returns it and wrapped as the watermill transport
// wraps it, after the context cases every classifier shares.
package classifytest

import (
	"context"
	"fmt"
	"testing"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Case is one error and the verdict documented for it. An alias of a
// struct literal type, so that tables can list cases without field names.
type Case = struct {
	Name string
	Err  error
	Want forwarder.Verdict
}

// Rejected, Unavailable and Ambiguous are the verdicts with code.
func Rejected(code string) forwarder.Verdict {
	return forwarder.Verdict{Outcome: forwarder.Rejected, Code: code}
}

// Unavailable is the unavailable verdict with code.
func Unavailable(code string) forwarder.Verdict {
	return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: code}
}

// Ambiguous is the ambiguous verdict with code.
func Ambiguous(code string) forwarder.Verdict {
	return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: code}
}

// Check runs classify on the context cases (CONTEXT_DEADLINE_EXCEEDED and
// CONTEXT_CANCELED, ambiguous) and on cases, each bare and wrapped with
// wrap, a format with one %w.
func Check(t *testing.T, classify func(error) forwarder.Verdict, wrap string, cases []Case) {
	t.Helper()
	all := append([]Case{
		{Name: "context deadline", Err: context.DeadlineExceeded, Want: Ambiguous("CONTEXT_DEADLINE_EXCEEDED")},
		{Name: "context canceled", Err: context.Canceled, Want: Ambiguous("CONTEXT_CANCELED")},
	}, cases...)
	for _, c := range all {
		t.Run(c.Name, func(t *testing.T) {
			for _, err := range []error{c.Err, fmt.Errorf(wrap, c.Err)} {
				if got := classify(err); got != c.Want {
					t.Errorf("Classify(%v) = %+v, want %+v", err, got, c.Want)
				}
			}
		})
	}
}
