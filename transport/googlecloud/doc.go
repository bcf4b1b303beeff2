// Package googlecloud connects the outbox relay to Google Cloud Pub/Sub
// through watermill-googlecloud (cloud.google.com/go/pubsub/v2).
//
// [NewPublisher] builds the downstream publisher the forwarder hands rows to.
// Its [Marshaler] keeps what the outbox promises:
//
//   - the watermill message UUID travels in the attribute
//     watermill-googlecloud reserves for it ("_watermill_message_uuid"), so a
//     watermill-googlecloud subscriber gets the same msg.UUID the business
//     transaction wrote (and the inbox can de-duplicate on it);
//   - every metadata entry, the canonical msg.* keys included, becomes a
//     Pub/Sub attribute with the same name;
//   - with Config.EnableMessageOrdering, msg.partition_key becomes the Pub/Sub
//     ordering key (messages without one are published unordered).
//
// Topics are not created on the fly unless Config.CreateMissingTopics is set:
// a typo in a destination is then a rejection the operator sees (the row is
// parked as FAILED) instead of a new topic nobody subscribes to.
//
// The client honours PUBSUB_EMULATOR_HOST and the usual Google credentials,
// so the same constructor reaches the in-process pstest server (tests pass a
// gRPC connection through Config.ClientOptions), an emulator, or a project.
//
// [Classify] tells the forwarder which errors are rejections (FAILED: the
// broker refused this message for good) and which are ambiguous (AMBIGUOUS:
// retried under the same id). Rejections: gRPC NotFound, InvalidArgument,
// PermissionDenied, FailedPrecondition, a missing topic found by the
// existence check, a message over the client's 10 MB request limit, and a
// message carrying the reserved UUID attribute. gRPC Unavailable (the
// service could not be reached) is unavailable: no attempt spent, the
// destination's breaker counts it. Everything else (DeadlineExceeded,
// Internal, Unknown, ResourceExhausted, Unauthenticated, cancelled contexts,
// paused ordering keys) is ambiguous. The client library retries
// Unavailable itself until its publish deadline, so an outage usually
// surfaces as DeadlineExceeded (ambiguous; the breaker opens on those too).
//
// Pub/Sub limits attributes (at most 100, names up to 256 bytes, values up
// to 1024 bytes); the service answers InvalidArgument, which classifies as a
// rejection. The pstest server does not enforce those limits or the 10 MB
// message limit (the client library enforces the latter itself).
package googlecloud
