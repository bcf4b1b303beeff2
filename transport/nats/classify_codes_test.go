package nats_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/nats"
)

// jsAPIError decodes the "error" object of a JetStream publish
// acknowledgement the way nats.go does for a refused publish.
func jsAPIError(t *testing.T, wire string) error {
	t.Helper()
	var e natsgo.APIError
	require.NoError(t, json.Unmarshal([]byte(wire), &e))
	return &e
}

// Every code docs/ERRORS.md promises for NATS, checked on the error values
// nats.go returns, bare and wrapped the way watermill-nats wraps them.
func TestClassifyGivesTheDocumentedCodes(t *testing.T) {
	rejected := func(code string) forwarder.Verdict {
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: code}
	}
	unavailable := func(code string) forwarder.Verdict {
		return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: code}
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
		{"no stream response", natsgo.ErrNoStreamResponse, unavailable("NATS_NO_STREAM")},
		{"no responders", natsgo.ErrNoResponders, unavailable("NATS_NO_STREAM")},
		{"max payload", natsgo.ErrMaxPayload, rejected("NATS_MAX_PAYLOAD")},
		{"message over stream max size", jsAPIError(t, `{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}`),
			rejected("NATS_JS_10054")},
		{"wrong last sequence", jsAPIError(t, `{"code":400,"err_code":10071,"description":"wrong last sequence: 3"}`),
			rejected("NATS_JS_10071")},
		{"stream not found", jsAPIError(t, `{"code":404,"err_code":10059,"description":"stream not found"}`),
			rejected("NATS_JS_10059")},
		{"jetstream temporarily unavailable", jsAPIError(t, `{"code":503,"err_code":10023,"description":"jetstream temporarily unavailable"}`),
			ambiguous("NATS_JS_10023")},
		{"timeout", natsgo.ErrTimeout, ambiguous("NATS_TIMEOUT")},
		// No connection to publish on: unavailable.
		{"connection closed", natsgo.ErrConnectionClosed, unavailable("NATS_CONNECTION")},
		{"connection draining", natsgo.ErrConnectionDraining, unavailable("NATS_CONNECTION")},
		{"invalid connection", natsgo.ErrInvalidConnection, unavailable("NATS_CONNECTION")},
		{"no servers", natsgo.ErrNoServers, unavailable("NATS_CONNECTION")},
		// The client may have sent it: ambiguous.
		{"disconnected", natsgo.ErrDisconnected, ambiguous("NATS_CONNECTION")},
		{"reconnecting", natsgo.ErrConnectionReconnecting, ambiguous("NATS_CONNECTION")},
		{"anything else", natsgo.ErrBadSubject, ambiguous("NATS_UNKNOWN")},
		{"invalid ack", natsgo.ErrInvalidJSAck, ambiguous("NATS_UNKNOWN")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, nats.Classify(tc.err), "error: %v", tc.err)
			wrapped := fmt.Errorf("sending message failed: %w", tc.err)
			require.Equal(t, tc.want, nats.Classify(wrapped), "error: %v", wrapped)
		})
	}
}
