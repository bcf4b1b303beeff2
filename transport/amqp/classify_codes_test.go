package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/amqp"
)

// Every code docs/ERRORS.md promises for AMQP, checked on the error values
// amqp091-go and watermill-amqp return, bare and wrapped the way
// watermill-amqp wraps them.
func TestClassifyGivesTheDocumentedCodes(t *testing.T) {
	rejected := func(code string) forwarder.Verdict {
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: code}
	}
	ambiguous := func(code string) forwarder.Verdict {
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: code}
	}
	cases := []struct {
		name string
		err  error
		want forwarder.Verdict
	}{
		{"context deadline", context.DeadlineExceeded, ambiguous("CONTEXT_DEADLINE_EXCEEDED")},
		{"context canceled", context.Canceled, ambiguous("CONTEXT_CANCELED")},
		// Failed: reply codes that refuse the publish for good.
		{"404 missing exchange", &amqp091.Error{Code: amqp091.NotFound, Reason: "NOT_FOUND - no exchange 'orders' in vhost '/'"},
			rejected("AMQP_NOT_FOUND")},
		{"403", &amqp091.Error{Code: amqp091.AccessRefused, Reason: "ACCESS_REFUSED - operation not permitted on the default exchange"},
			rejected("AMQP_ACCESS_REFUSED")},
		{"406", &amqp091.Error{Code: amqp091.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'type'"},
			rejected("AMQP_PRECONDITION_FAILED")},
		{"311", &amqp091.Error{Code: amqp091.ContentTooLarge, Reason: "message size larger than max size"},
			rejected("AMQP_CONTENT_TOO_LARGE")},
		{"530", &amqp091.Error{Code: amqp091.NotAllowed, Reason: "NOT_ALLOWED"}, rejected("AMQP_NOT_ALLOWED")},
		{"540", &amqp091.Error{Code: amqp091.NotImplemented, Reason: "NOT_IMPLEMENTED"}, rejected("AMQP_NOT_IMPLEMENTED")},
		// Any other reply code: ambiguous, by number.
		{"320 connection forced", &amqp091.Error{Code: amqp091.ConnectionForced, Reason: "CONNECTION_FORCED - broker forced connection closure"},
			ambiguous("AMQP_320")},
		{"541 internal error", &amqp091.Error{Code: amqp091.InternalError, Reason: "INTERNAL_ERROR"}, ambiguous("AMQP_541")},
		{"506 resource error", &amqp091.Error{Code: amqp091.ResourceError, Reason: "RESOURCE_ERROR"}, ambiguous("AMQP_506")},
		{"504 channel error from the broker", &amqp091.Error{Code: amqp091.ChannelError, Reason: "CHANNEL_ERROR"}, ambiguous("AMQP_504")},
		// Closed before the publish was written.
		{"closed", amqp091.ErrClosed, forwarder.Verdict{Outcome: forwarder.Unavailable, Code: "AMQP_CONNECTION_CLOSED"}},
		// No reply code: nack without reason, not connected.
		{"nack", fmt.Errorf("delivery not confirmed for message [%s]", "m1"), ambiguous("AMQP_UNKNOWN")},
		{"not connected", errors.New("not connected to AMQP"), ambiguous("AMQP_UNKNOWN")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, amqp.Classify(tc.err), "error: %v", tc.err)
			wrapped := fmt.Errorf("cannot publish msg: %w", tc.err)
			require.Equal(t, tc.want, amqp.Classify(wrapped), "error: %v", wrapped)
		})
	}
}
