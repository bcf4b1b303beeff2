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
// subject no stream captures holds its destination's backlog (breaker open,
// relay not ready) until a stream answers.
//
// [Classify]: no stream for the subject ("no response from stream" / no
// responders: a missing stream, or JetStream down) and a closed or absent
// connection are unavailable (no attempt spent; the destination's breaker
// counts them). A payload over the server's max_payload and JetStream API
// errors with status 400, 404 or 409 (for example a message larger than the
// stream's max_msg_size, a failed expectation) are rejections (FAILED).
// Timeouts, a disconnected or reconnecting connection (the client may have
// sent the message), JetStream API errors with other statuses (503:
// JetStream temporarily unavailable) and cancelled contexts are ambiguous.
package nats
