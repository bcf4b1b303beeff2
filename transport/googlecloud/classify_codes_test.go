package googlecloud_test

import (
	"fmt"
	"testing"

	"cloud.google.com/go/pubsub/v2"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/classifytest"
)

// Every code docs/ERRORS.md promises for Pub/Sub, checked on the error
// values the client libraries return, bare and wrapped the way
// watermill-googlecloud wraps them.
func TestClassifyGivesTheDocumentedCodes(t *testing.T) {
	msg := message.NewMessage("m1", []byte("x"))
	msg.Metadata.Set(wgc.UUIDHeaderKey, "forged")
	_, reservedErr := googlecloud.Marshaler{}.Marshal("orders", msg)
	require.Error(t, reservedErr)

	classifytest.Check(t, googlecloud.Classify, "publishing message m1 failed: %w", []classifytest.Case{
		{"reserved attribute", reservedErr, classifytest.Rejected("PUBSUB_RESERVED_ATTRIBUTE")},
		{"topic not found", fmt.Errorf("orders: %w", wgc.ErrTopicDoesNotExist), classifytest.Rejected("PUBSUB_TOPIC_NOT_FOUND")},
		{"message too large", pubsub.ErrOversizedMessage, classifytest.Rejected("PUBSUB_MESSAGE_TOO_LARGE")},
		{"ordering key paused", pubsub.ErrPublishingPaused{OrderingKey: "k"}, classifytest.Ambiguous("PUBSUB_ORDERING_KEY_PAUSED")},
		{"grpc permission denied", status.Error(codes.PermissionDenied, "denied"), classifytest.Rejected("PUBSUB_PERMISSION_DENIED")},
		{"grpc not found", status.Error(codes.NotFound, "Resource not found"), classifytest.Rejected("PUBSUB_NOT_FOUND")},
		{"grpc invalid argument", status.Error(codes.InvalidArgument, "too many attributes"), classifytest.Rejected("PUBSUB_INVALID_ARGUMENT")},
		{"grpc failed precondition", status.Error(codes.FailedPrecondition, "precondition"), classifytest.Rejected("PUBSUB_FAILED_PRECONDITION")},
		{"grpc unavailable", status.Error(codes.Unavailable, "connection refused"),
			classifytest.Unavailable("PUBSUB_UNAVAILABLE")},
		{"grpc deadline exceeded", status.Error(codes.DeadlineExceeded, "deadline"), classifytest.Ambiguous("PUBSUB_DEADLINE_EXCEEDED")},
		{"grpc internal", status.Error(codes.Internal, "internal"), classifytest.Ambiguous("PUBSUB_INTERNAL")},
		{"grpc resource exhausted", status.Error(codes.ResourceExhausted, "quota"), classifytest.Ambiguous("PUBSUB_RESOURCE_EXHAUSTED")},
		{"grpc unauthenticated", status.Error(codes.Unauthenticated, "token"), classifytest.Ambiguous("PUBSUB_UNAUTHENTICATED")},
		{"grpc canceled", status.Error(codes.Canceled, "canceled"), classifytest.Ambiguous("PUBSUB_CANCELLED")},
		// Not a gRPC status, or a status without a usable code.
		{"plain error", fmt.Errorf("connection reset by peer"), classifytest.Ambiguous("PUBSUB_UNKNOWN")},
		{"grpc unknown", status.Error(codes.Unknown, "unknown"), classifytest.Ambiguous("PUBSUB_UNKNOWN")},
		{"publisher closed", wgc.ErrPublisherClosed, classifytest.Ambiguous("PUBSUB_UNKNOWN")},
	})
}
