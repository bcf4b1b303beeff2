package nats_test

import (
	"encoding/json"
	"testing"

	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/classifytest"
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
	classifytest.Check(t, nats.Classify, "sending message failed: %w", []classifytest.Case{
		{"no stream response", natsgo.ErrNoStreamResponse, classifytest.Unavailable("NATS_NO_STREAM")},
		{"no responders", natsgo.ErrNoResponders, classifytest.Unavailable("NATS_NO_STREAM")},
		{"max payload", natsgo.ErrMaxPayload, classifytest.Rejected("NATS_MAX_PAYLOAD")},
		{"message over stream max size", jsAPIError(t, `{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}`),
			classifytest.Rejected("NATS_JS_10054")},
		{"wrong last sequence", jsAPIError(t, `{"code":400,"err_code":10071,"description":"wrong last sequence: 3"}`),
			classifytest.Rejected("NATS_JS_10071")},
		{"stream not found", jsAPIError(t, `{"code":404,"err_code":10059,"description":"stream not found"}`),
			classifytest.Rejected("NATS_JS_10059")},
		{"jetstream temporarily unavailable", jsAPIError(t, `{"code":503,"err_code":10023,"description":"jetstream temporarily unavailable"}`),
			classifytest.Ambiguous("NATS_JS_10023")},
		{"timeout", natsgo.ErrTimeout, classifytest.Ambiguous("NATS_TIMEOUT")},
		// No connection to publish on: unavailable.
		{"connection closed", natsgo.ErrConnectionClosed, classifytest.Unavailable("NATS_CONNECTION")},
		{"connection draining", natsgo.ErrConnectionDraining, classifytest.Unavailable("NATS_CONNECTION")},
		{"invalid connection", natsgo.ErrInvalidConnection, classifytest.Unavailable("NATS_CONNECTION")},
		{"no servers", natsgo.ErrNoServers, classifytest.Unavailable("NATS_CONNECTION")},
		// The client may have sent it: ambiguous.
		{"disconnected", natsgo.ErrDisconnected, classifytest.Ambiguous("NATS_CONNECTION")},
		{"reconnecting", natsgo.ErrConnectionReconnecting, classifytest.Ambiguous("NATS_CONNECTION")},
		{"anything else", natsgo.ErrBadSubject, classifytest.Ambiguous("NATS_UNKNOWN")},
		{"invalid ack", natsgo.ErrInvalidJSAck, classifytest.Ambiguous("NATS_UNKNOWN")},
	})
}
