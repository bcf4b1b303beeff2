// Package tracee2e holds the end-to-end tracing test: one trace from an HTTP
// handler's span, through the outbox row, the relay's publish span and a
// real NATS JetStream server, to the consumer's handler span
// (inbox.TraceMiddleware), recorded with the OpenTelemetry SDK's in-memory
// exporter. It is a module of its own because it needs the SDK and a
// transport, which the core must not require.
package tracee2e
