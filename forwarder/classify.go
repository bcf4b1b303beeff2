package forwarder

import (
	"errors"
	"fmt"
)

// Outcome is what a publish attempt achieved, as far as the relay can tell.
type Outcome int

const (
	// Confirmed: the broker acknowledged the message; the row is PUBLISHED.
	Confirmed Outcome = iota + 1
	// Rejected: the broker refused the message for good (it will refuse it
	// again); the row is parked FAILED.
	Rejected
	// Ambiguous: nobody knows whether the message got through (timeout,
	// connection lost, broker busy). The row is retried under the same
	// message id after a backoff, or parked EXHAUSTED when its budget is spent.
	Ambiguous
)

func (o Outcome) String() string {
	switch o {
	case Confirmed:
		return "confirmed"
	case Rejected:
		return "rejected"
	case Ambiguous:
		return "ambiguous"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Verdict is a classifier's answer: the outcome and a stable code stored in
// last_failure_code (empty: the forwarder's generic code for the outcome).
type Verdict struct {
	Outcome Outcome
	Code    string
}

// Classifier turns a non-nil publish error into a verdict. It must be safe
// for concurrent use. A verdict with an Outcome the forwarder does not know
// is recorded as ambiguous and the pass fails with FORWARDER_UNKNOWN_OUTCOME.
type Classifier func(err error) Verdict

// Failure codes the forwarder writes to last_failure_code.
const (
	FailurePublishError    = "PUBLISH_ERROR"    // an error the classifier called ambiguous without a code
	FailurePublishRejected = "PUBLISH_REJECTED" // a rejection without a code
	FailurePublishTimeout  = "PUBLISH_TIMEOUT"  // Publish did not return within PublishTimeout (or the drain deadline)
	FailurePublishPanic    = "PUBLISH_PANIC"    // the downstream publisher panicked
	FailureUnknownOutcome  = "FORWARDER_UNKNOWN_OUTCOME"
)

type rejection struct {
	err  error
	code string
}

func (r *rejection) Error() string {
	if r.err == nil {
		return "rejected: " + r.code
	}
	return r.err.Error()
}

func (r *rejection) Unwrap() error { return r.err }

// Reject marks err as a permanent rejection with a stable code, recognised
// by DefaultClassifier: the row is parked FAILED instead of retried. Use it in
// a publisher decorator that knows the broker will never accept the message
// (schema violation, message too large). An empty code becomes
// PUBLISH_REJECTED.
func Reject(err error, code string) error {
	if code == "" {
		code = FailurePublishRejected
	}
	return &rejection{err: err, code: code}
}

// RejectionCode returns the code given to Reject anywhere in err's chain.
func RejectionCode(err error) (string, bool) {
	var r *rejection
	if errors.As(err, &r) {
		return r.code, true
	}
	return "", false
}

// DefaultClassifier treats errors wrapped with Reject as rejections and
// every other error as ambiguous: without knowledge of the transport, an
// error after Publish was called may still mean the broker has the message.
func DefaultClassifier(err error) Verdict {
	if err == nil {
		return Verdict{Outcome: Confirmed}
	}
	if code, ok := RejectionCode(err); ok {
		return Verdict{Outcome: Rejected, Code: code}
	}
	return Verdict{Outcome: Ambiguous, Code: FailurePublishError}
}
