package nats

import (
	"errors"
	"strconv"

	natsgo "github.com/nats-io/nats.go"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/outcome"
)

// Codes stored in last_failure_code by Classify.
const (
	CodeNoStream   = "NATS_NO_STREAM"
	CodeMaxPayload = "NATS_MAX_PAYLOAD"
	CodeTimeout    = "NATS_TIMEOUT"
	CodeConnection = "NATS_CONNECTION"
	CodeUnknown    = "NATS_UNKNOWN"
	codeAPIPrefix  = "NATS_JS_" // + the JetStream error code, e.g. NATS_JS_10054
)

// JetStream API statuses that refuse this message for good: bad request
// (too large for the stream, invalid headers), not found, conflict (a failed
// publish expectation).
var rejectedStatus = map[int]bool{400: true, 404: true, 409: true}

// Classify is a forwarder.Classifier for NATS JetStream publish errors: pass
// it as forwarder.Config.Classifier. The rules are in the package
// documentation.
func Classify(err error) forwarder.Verdict {
	if err == nil {
		return forwarder.Verdict{Outcome: forwarder.Confirmed}
	}
	switch {
	case errors.Is(err, natsgo.ErrNoStreamResponse), errors.Is(err, natsgo.ErrNoResponders):
		// Nothing answered for the subject: JetStream never saw the
		// message. That is a missing stream or JetStream being down; both
		// are the destination as a whole, not this message, so no attempt
		// is spent and the breaker holds the backlog until a stream answers.
		return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: CodeNoStream}
	case errors.Is(err, natsgo.ErrMaxPayload):
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: CodeMaxPayload}
	}
	var apiErr *natsgo.APIError
	if errors.As(err, &apiErr) {
		code := codeAPIPrefix + strconv.Itoa(int(apiErr.ErrorCode))
		if rejectedStatus[apiErr.Code] {
			return forwarder.Verdict{Outcome: forwarder.Rejected, Code: code}
		}
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: code}
	}
	switch {
	case errors.Is(err, natsgo.ErrTimeout):
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeTimeout}
	case errors.Is(err, natsgo.ErrConnectionClosed), errors.Is(err, natsgo.ErrConnectionDraining),
		errors.Is(err, natsgo.ErrInvalidConnection), errors.Is(err, natsgo.ErrNoServers):
		// No connection to publish on: the message was not sent.
		return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: CodeConnection}
	case errors.Is(err, natsgo.ErrDisconnected), errors.Is(err, natsgo.ErrConnectionReconnecting):
		// The client may have buffered or sent it before losing the server.
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeConnection}
	}
	if r, ok := outcome.Context(err); ok {
		return r
	}
	return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeUnknown}
}

var _ forwarder.Classifier = Classify
