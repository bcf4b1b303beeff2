package amqp_test

import (
	"errors"
	"fmt"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fencedoutbox/watermill-outbox/transport/amqp"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/classifytest"
)

// Every code docs/ERRORS.md promises for AMQP, checked on the error values
// amqp091-go and watermill-amqp return, bare and wrapped the way
// watermill-amqp wraps them.
func TestClassifyGivesTheDocumentedCodes(t *testing.T) {
	classifytest.Check(t, amqp.Classify, "cannot publish msg: %w", []classifytest.Case{
		// Failed: reply codes that refuse the publish for good.
		{"404 missing exchange", &amqp091.Error{Code: amqp091.NotFound, Reason: "NOT_FOUND - no exchange 'orders' in vhost '/'"},
			classifytest.Rejected("AMQP_NOT_FOUND")},
		{"403", &amqp091.Error{Code: amqp091.AccessRefused, Reason: "ACCESS_REFUSED - operation not permitted on the default exchange"},
			classifytest.Rejected("AMQP_ACCESS_REFUSED")},
		{"406", &amqp091.Error{Code: amqp091.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'type'"},
			classifytest.Rejected("AMQP_PRECONDITION_FAILED")},
		{"311", &amqp091.Error{Code: amqp091.ContentTooLarge, Reason: "message size larger than max size"},
			classifytest.Rejected("AMQP_CONTENT_TOO_LARGE")},
		{"530", &amqp091.Error{Code: amqp091.NotAllowed, Reason: "NOT_ALLOWED"}, classifytest.Rejected("AMQP_NOT_ALLOWED")},
		{"540", &amqp091.Error{Code: amqp091.NotImplemented, Reason: "NOT_IMPLEMENTED"}, classifytest.Rejected("AMQP_NOT_IMPLEMENTED")},
		// Any other reply code: ambiguous, by number.
		{"320 connection forced", &amqp091.Error{Code: amqp091.ConnectionForced, Reason: "CONNECTION_FORCED - broker forced connection closure"},
			classifytest.Ambiguous("AMQP_320")},
		{"541 internal error", &amqp091.Error{Code: amqp091.InternalError, Reason: "INTERNAL_ERROR"}, classifytest.Ambiguous("AMQP_541")},
		{"506 resource error", &amqp091.Error{Code: amqp091.ResourceError, Reason: "RESOURCE_ERROR"}, classifytest.Ambiguous("AMQP_506")},
		{"504 channel error from the broker", &amqp091.Error{Code: amqp091.ChannelError, Reason: "CHANNEL_ERROR"}, classifytest.Ambiguous("AMQP_504")},
		// Closed before the publish was written.
		{"closed", amqp091.ErrClosed, classifytest.Unavailable("AMQP_CONNECTION_CLOSED")},
		// No reply code: nack without reason, not connected.
		{"nack", fmt.Errorf("delivery not confirmed for message [%s]", "m1"), classifytest.Ambiguous("AMQP_UNKNOWN")},
		{"not connected", errors.New("not connected to AMQP"), classifytest.Ambiguous("AMQP_UNKNOWN")},
	})
}
