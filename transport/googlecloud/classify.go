package googlecloud

import (
	"errors"

	"cloud.google.com/go/pubsub/v2"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/outcome"
)

// Codes stored in last_failure_code by Classify.
const (
	CodeTopicNotFound   = "PUBSUB_TOPIC_NOT_FOUND"
	CodeMessageTooLarge = "PUBSUB_MESSAGE_TOO_LARGE"
	CodeOrderingPaused  = "PUBSUB_ORDERING_KEY_PAUSED"
	CodeUnknown         = "PUBSUB_UNKNOWN"
)

// gRPC codes that say the service refused this publish for good: the same
// request would be refused again until someone changes the topic, the
// permissions or the message (then redrives the FAILED row).
var rejectedCodes = map[codes.Code]bool{
	codes.NotFound:           true,
	codes.InvalidArgument:    true,
	codes.PermissionDenied:   true,
	codes.FailedPrecondition: true,
}

// Classify is a forwarder.Classifier for Pub/Sub publish errors: pass it as
// forwarder.Config.Classifier. The rules are in the package documentation.
func Classify(err error) forwarder.Verdict {
	if err == nil {
		return forwarder.Verdict{Outcome: forwarder.Confirmed}
	}
	switch {
	case errors.Is(err, ErrReservedAttribute):
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: string(CodeReservedAttribute)}
	case errors.Is(err, wgc.ErrTopicDoesNotExist):
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: CodeTopicNotFound}
	case errors.Is(err, pubsub.ErrOversizedMessage):
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: CodeMessageTooLarge}
	}
	var paused pubsub.ErrPublishingPaused
	if errors.As(err, &paused) {
		// An earlier publish with this ordering key failed; the key resumes
		// (automatically with EnableMessageOrdering) and a retry can succeed.
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeOrderingPaused}
	}
	// A gRPC status wins over the context rule: the client library reports a
	// server-side deadline as codes.DeadlineExceeded, which is ambiguous too.
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
		kind := forwarder.Ambiguous
		switch {
		case rejectedCodes[st.Code()]:
			kind = forwarder.Rejected
		case st.Code() == codes.Unavailable:
			// The service could not be reached: the downstream as a whole
			// is down (its breaker, not the row's budget, deals with it).
			kind = forwarder.Unavailable
		}
		return forwarder.Verdict{Outcome: kind, Code: "PUBSUB_" + grpcName(st.Code())}
	}
	if r, ok := outcome.Context(err); ok {
		return r
	}
	return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeUnknown}
}

// grpcName spells a gRPC code the way the protocol does (NOT_FOUND), which
// is what operators search for: the names of google.rpc.Code.
func grpcName(c codes.Code) string {
	if n, ok := rpccode.Code_name[int32(c)]; ok && c != codes.OK {
		return n
	}
	return "UNKNOWN"
}

var _ forwarder.Classifier = Classify
