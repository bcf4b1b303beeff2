// Package amqp connects the outbox relay to RabbitMQ (AMQP 0-9-1) through
// watermill-amqp.
//
// [NewPublisher] uses watermill-amqp's durable pub/sub layout (the topic is a
// durable fanout exchange; consumers bind their own queues) with publisher
// confirms always on, so a nil error means the broker confirmed the message.
// watermill-amqp's marshaler carries the UUID in the
// "_watermill_message_uuid" header and every metadata entry (canonical msg.*
// keys included) as a header, with persistent delivery.
//
// Exchanges are not created on the fly unless Config.CreateMissingExchanges
// is set: the publisher declares them passively, so a missing exchange is a
// 404 NOT_FOUND rejection the operator sees instead of an exchange that
// silently drops every message for lack of bound queues. (With fanout
// exchanges a message published while no queue is bound is confirmed and
// dropped by RabbitMQ; bind consumer queues before relaying.)
//
// [Classify]: channel and connection exceptions 404 NOT_FOUND, 403
// ACCESS_REFUSED, 406 PRECONDITION_FAILED, 311 CONTENT_TOO_LARGE, 530
// NOT_ALLOWED and 540 NOT_IMPLEMENTED are rejections (FAILED). A connection or
// channel closed before the publish was written is unavailable
// (AMQP_CONNECTION_CLOSED: no attempt spent, the destination's breaker counts
// it). Everything else is ambiguous: a negative or missing confirm (RabbitMQ
// nacks only on internal errors and gives no reason), not being connected,
// timeouts, cancelled contexts.
package amqp
