package googlecloud_test

import (
	"context"
	"fmt"
	"testing"

	"cloud.google.com/go/pubsub/v2"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
)

// Every code docs/ERRORS.md promises for Pub/Sub, checked on the error
// values the client libraries return, bare and wrapped the way
// watermill-googlecloud wraps them.
func TestClassifyGivesTheDocumentedCodes(t *testing.T) {
	msg := message.NewMessage("m1", []byte("x"))
	msg.Metadata.Set(wgc.UUIDHeaderKey, "forged")
	_, reservedErr := googlecloud.Marshaler{}.Marshal("orders", msg)
	require.Error(t, reservedErr)

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
		{"reserved attribute", reservedErr, rejected("PUBSUB_RESERVED_ATTRIBUTE")},
		{"topic not found", fmt.Errorf("orders: %w", wgc.ErrTopicDoesNotExist), rejected("PUBSUB_TOPIC_NOT_FOUND")},
		{"message too large", pubsub.ErrOversizedMessage, rejected("PUBSUB_MESSAGE_TOO_LARGE")},
		{"ordering key paused", pubsub.ErrPublishingPaused{OrderingKey: "k"}, ambiguous("PUBSUB_ORDERING_KEY_PAUSED")},
		{"grpc permission denied", status.Error(codes.PermissionDenied, "denied"), rejected("PUBSUB_PERMISSION_DENIED")},
		{"grpc not found", status.Error(codes.NotFound, "Resource not found"), rejected("PUBSUB_NOT_FOUND")},
		{"grpc invalid argument", status.Error(codes.InvalidArgument, "too many attributes"), rejected("PUBSUB_INVALID_ARGUMENT")},
		{"grpc failed precondition", status.Error(codes.FailedPrecondition, "precondition"), rejected("PUBSUB_FAILED_PRECONDITION")},
		{"grpc unavailable", status.Error(codes.Unavailable, "connection refused"),
			forwarder.Verdict{Outcome: forwarder.Unavailable, Code: "PUBSUB_UNAVAILABLE"}},
		{"grpc deadline exceeded", status.Error(codes.DeadlineExceeded, "deadline"), ambiguous("PUBSUB_DEADLINE_EXCEEDED")},
		{"grpc internal", status.Error(codes.Internal, "internal"), ambiguous("PUBSUB_INTERNAL")},
		{"grpc resource exhausted", status.Error(codes.ResourceExhausted, "quota"), ambiguous("PUBSUB_RESOURCE_EXHAUSTED")},
		{"grpc unauthenticated", status.Error(codes.Unauthenticated, "token"), ambiguous("PUBSUB_UNAUTHENTICATED")},
		{"grpc canceled", status.Error(codes.Canceled, "canceled"), ambiguous("PUBSUB_CANCELLED")},
		// Not a gRPC status, or a status without a usable code.
		{"plain error", fmt.Errorf("connection reset by peer"), ambiguous("PUBSUB_UNKNOWN")},
		{"grpc unknown", status.Error(codes.Unknown, "unknown"), ambiguous("PUBSUB_UNKNOWN")},
		{"publisher closed", wgc.ErrPublisherClosed, ambiguous("PUBSUB_UNKNOWN")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, googlecloud.Classify(tc.err), "error: %v", tc.err)
			wrapped := fmt.Errorf("publishing message m1 failed: %w", tc.err)
			require.Equal(t, tc.want, googlecloud.Classify(wrapped), "error: %v", wrapped)
		})
	}
}
