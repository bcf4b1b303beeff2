package kafka_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/kafka"
)

// Every code docs/ERRORS.md promises for Kafka, checked on the error values
// sarama returns, bare and wrapped the way watermill-kafka wraps them.
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
		// Failed: the broker refuses the record for good (protocol names).
		{"message too large", sarama.ErrMessageSizeTooLarge, rejected("KAFKA_MESSAGE_TOO_LARGE")},
		{"unknown topic", sarama.ErrUnknownTopicOrPartition, rejected("KAFKA_UNKNOWN_TOPIC_OR_PARTITION")},
		{"topic authorization", sarama.ErrTopicAuthorizationFailed, rejected("KAFKA_TOPIC_AUTHORIZATION_FAILED")},
		{"record list too large", sarama.ErrMessageSetSizeTooLarge, rejected("KAFKA_RECORD_LIST_TOO_LARGE")},
		{"invalid topic", sarama.ErrInvalidTopic, rejected("KAFKA_INVALID_TOPIC_EXCEPTION")},
		{"invalid record", sarama.ErrInvalidRecord, rejected("KAFKA_INVALID_RECORD")},
		{"invalid timestamp", sarama.ErrInvalidTimestamp, rejected("KAFKA_INVALID_TIMESTAMP")},
		{"cluster authorization", sarama.ErrClusterAuthorizationFailed, rejected("KAFKA_CLUSTER_AUTHORIZATION_FAILED")},
		{"policy violation", sarama.ErrPolicyViolation, rejected("KAFKA_POLICY_VIOLATION")},
		{"in a producer error", &sarama.ProducerError{Msg: &sarama.ProducerMessage{Topic: "orders"}, Err: sarama.ErrMessageSizeTooLarge},
			rejected("KAFKA_MESSAGE_TOO_LARGE")},
		// Unavailable: the record was not appended.
		{"broker not available", sarama.ErrBrokerNotAvailable, unavailable("KAFKA_BROKER_NOT_AVAILABLE")},
		{"leader not available", sarama.ErrLeaderNotAvailable, unavailable("KAFKA_LEADER_NOT_AVAILABLE")},
		{"not enough replicas", sarama.ErrNotEnoughReplicas, unavailable("KAFKA_NOT_ENOUGH_REPLICAS")},
		{"storage error", sarama.ErrKafkaStorageError, unavailable("KAFKA_KAFKA_STORAGE_ERROR")},
		{"replica not available", sarama.ErrReplicaNotAvailable, unavailable("KAFKA_REPLICA_NOT_AVAILABLE")},
		// No broker: the record never left the client.
		{"out of brokers", sarama.ErrOutOfBrokers, unavailable("KAFKA_NO_BROKER")},
		{"not connected", sarama.ErrNotConnected, unavailable("KAFKA_NO_BROKER")},
		{"client closed", sarama.ErrClosedClient, unavailable("KAFKA_NO_BROKER")},
		// Any other Kafka error code: ambiguous, by number.
		{"not leader", sarama.ErrNotLeaderForPartition, ambiguous("KAFKA_ERROR_6")},
		{"request timed out", sarama.ErrRequestTimedOut, ambiguous("KAFKA_ERROR_7")},
		{"network exception", sarama.ErrNetworkException, ambiguous("KAFKA_ERROR_13")},
		{"not enough replicas after append", sarama.ErrNotEnoughReplicasAfterAppend, ambiguous("KAFKA_ERROR_20")},
		// sarama refused the record before sending.
		{"over MaxMessageBytes", sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 2000 > 1000"),
			rejected("KAFKA_CLIENT_REFUSED")},
		// Nothing with a Kafka code.
		{"eof", io.EOF, ambiguous("KAFKA_UNKNOWN")},
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, ambiguous("KAFKA_UNKNOWN")},
		{"i/o timeout is not a context deadline", &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, ambiguous("KAFKA_UNKNOWN")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, kafka.Classify(tc.err), "error: %v", tc.err)
			wrapped := fmt.Errorf("cannot produce message m1: %w", tc.err)
			require.Equal(t, tc.want, kafka.Classify(wrapped), "error: %v", wrapped)
		})
	}
}
