package forwarder

import (
	"cmp"
	"errors"
	"fmt"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
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
	// Unavailable: the downstream as a whole is unavailable and did not take
	// the message (connection refused or lost before sending, no broker).
	// The row is put back without spending an attempt, and the failure
	// counts towards its destination's breaker.
	Unavailable
)

func (o Outcome) String() string {
	switch o {
	case Confirmed:
		return "confirmed"
	case Rejected:
		return "rejected"
	case Ambiguous:
		return "ambiguous"
	case Unavailable:
		return "unavailable"
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

// DefaultClassifier treats errors wrapped with Reject as rejections, errors
// wrapped with Unavailable as unavailable, and every other error as
// ambiguous: without knowledge of the transport, an error after Publish was
// called may still mean the broker has the message. (Under the default
// classifier the forwarder also takes a pass in which every publish to a
// destination failed with the same error, on two messages or more, as
// evidence that the destination is unavailable: see Config.Classifier.
// Not when each of those messages was already put back so, with the same
// error, and the destination has confirmed another message since: they
// fail on their own, and spend their attempts.)
func DefaultClassifier(err error) Verdict {
	if err == nil {
		return Verdict{Outcome: Confirmed}
	}
	if code, ok := RejectionCode(err); ok {
		return Verdict{Outcome: Rejected, Code: code}
	}
	if IsUnavailable(err) {
		return Verdict{Outcome: Unavailable, Code: FailureDownstreamUnavailable}
	}
	return Verdict{Outcome: Ambiguous, Code: FailurePublishError}
}

// FailureDownstreamUnavailable is written to last_failure_code of a row
// released without an attempt because its downstream was unavailable as a
// whole (an Unavailable verdict, or its destination's breaker open).
const FailureDownstreamUnavailable = "DOWNSTREAM_UNAVAILABLE"

// FailureDownstreamFailing is written to last_failure_code of a row put back
// without an attempt under the default classifier's pass-wide rule: every
// publish to its destination in the pass failed the same way. The default
// classifier cannot tell whether the broker took the message, so when the
// row goes out later it is counted as a possible duplicate.
const FailureDownstreamFailing = "DOWNSTREAM_FAILING"

type unavailable struct{ err error }

func (u *unavailable) Error() string {
	if u.err == nil {
		return "downstream unavailable"
	}
	return u.err.Error()
}

func (u *unavailable) Unwrap() error { return u.err }

// MarkUnavailable marks err as "the downstream as a whole is unavailable and
// did not take the message" (connection refused or lost before sending, no
// broker, no route), recognised by DefaultClassifier: the row is put back
// without spending an attempt and the failure counts towards its
// destination's breaker. Use it only when the message cannot have reached
// the broker; when it may have, the error is ambiguous.
func MarkUnavailable(err error) error { return &unavailable{err: err} }

// IsUnavailable reports whether err was marked with MarkUnavailable.
func IsUnavailable(err error) bool {
	var u *unavailable
	return errors.As(err, &u)
}

// classify sets it's outcome from the publish result s.
func (x *executor) classify(it *item, s sent) {
	row := &it.claimed.Row
	attempt := row.Attempts + 1
	it.err = s.err
	var v Verdict
	switch {
	case s.code != "":
		v = Verdict{Outcome: Ambiguous, Code: s.code}
	case s.err == nil:
		v = Verdict{Outcome: Confirmed}
	default:
		v = x.cfg.Classifier(s.err)
	}
	switch v.Outcome {
	case Confirmed:
		it.outcome = fencing.Outcome{To: envelope.StatusPublished}
		return
	case Rejected:
		it.outcome = fencing.Outcome{To: envelope.StatusFailed, Code: cmp.Or(v.Code, FailurePublishRejected), Detail: errText(s.err)}
		return
	case Unavailable:
		// The downstream as a whole did not take it: back without an
		// attempt, held off so that probes take other rows; the breaker,
		// not the budget, deals with the outage.
		it.outcome = fencing.Outcome{To: envelope.StatusPending, Code: cmp.Or(v.Code, FailureDownstreamUnavailable), Detail: errText(s.err),
			RetryAfter: x.breakers.holdOff(row.Destination, x.cfg.BreakerProbeBase)}
		it.unavailable = true
		return
	case Ambiguous:
		v.Code = cmp.Or(v.Code, FailurePublishError)
	default:
		// Loud, but never silent: the row is written AMBIGUOUS (the safe
		// reading of "we do not know") and the pass reports the error.
		it.unknown = true
		v.Code = FailureUnknownOutcome
	}
	if attempt >= x.cfg.MaxAttempts {
		it.outcome = fencing.Outcome{To: envelope.StatusExhausted, Code: v.Code, Detail: errText(s.err)}
		return
	}
	// The delay, not a local deadline: the outcome statement adds it to the
	// clock the claim compares with (Config.Now, or the database's now()),
	// so host clock skew neither removes nor stretches the backoff.
	it.outcome = fencing.Outcome{
		To: envelope.StatusAmbiguous, Code: v.Code, Detail: errText(s.err),
		RetryAfter: x.retryDelay(row.MessageID, attempt),
	}
}
