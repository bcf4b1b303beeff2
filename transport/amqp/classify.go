package amqp

import (
	"errors"
	"strconv"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/outcome"
)

// Codes stored in last_failure_code by Classify besides AMQP_<reply code>.
const (
	// CodeClosed: the connection or channel was closed before the publish
	// was written (unavailable: no attempt spent).
	CodeClosed = "AMQP_CONNECTION_CLOSED"
	// CodeUnknown is stored for errors that carry no AMQP reply code.
	CodeUnknown = "AMQP_UNKNOWN"
)

// Reply codes that refuse this publish for good, by their protocol names.
var rejected = map[int]string{
	amqp091.NotFound:           "NOT_FOUND",
	amqp091.AccessRefused:      "ACCESS_REFUSED",
	amqp091.PreconditionFailed: "PRECONDITION_FAILED",
	amqp091.ContentTooLarge:    "CONTENT_TOO_LARGE",
	amqp091.NotAllowed:         "NOT_ALLOWED",
	amqp091.NotImplemented:     "NOT_IMPLEMENTED",
}

// Classify is a forwarder.Classifier for AMQP publish errors: pass it as
// forwarder.Config.Classifier. The rules are in the package documentation.
func Classify(err error) forwarder.Verdict {
	if err == nil {
		return forwarder.Verdict{Outcome: forwarder.Confirmed}
	}
	if errors.Is(err, amqp091.ErrClosed) {
		// The connection or channel was closed before the publish was
		// written: nothing reached the broker.
		return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: CodeClosed}
	}
	var aerr *amqp091.Error
	if errors.As(err, &aerr) {
		if name, ok := rejected[aerr.Code]; ok {
			return forwarder.Verdict{Outcome: forwarder.Rejected, Code: "AMQP_" + name}
		}
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: "AMQP_" + strconv.Itoa(aerr.Code)}
	}
	if r, ok := outcome.Context(err); ok {
		return r
	}
	return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeUnknown}
}

var _ forwarder.Classifier = Classify
