// Package nats connects the outbox relay to NATS JetStream through
// watermill-nats (pkg/nats with JetStream enabled, the variant
// watermill-nats recommends for production).
//
// [NewPublisher] publishes each message synchronously and waits for the
// stream's acknowledgement, so a nil error means the stream stored it. The
// topic is the subject; watermill-nats's marshaler carries the UUID in the
// "_watermill_message_uuid" header and metadata (canonical msg.* keys
// included) as headers. The UUID is also sent as the JetStream message id
// (Nats-Msg-Id), so a relay retry inside the stream's duplicate window is
// stored once.
//
// Streams are not created on the fly unless Config.AutoProvision is set: a
// subject no stream captures is a rejection the operator sees.
//
// [Classify]: no stream for the subject ("no response from stream" / no
// responders), a payload over the server's max_payload, and JetStream API
// errors with status 400, 404 or 409 (for example a message larger than the
// stream's max_msg_size, a missing stream, a failed expectation) are
// rejections (FAILED). Timeouts, a disconnected or closed connection,
// JetStream API errors with other statuses (503: JetStream temporarily
// unavailable) and cancelled contexts are ambiguous.
package nats
