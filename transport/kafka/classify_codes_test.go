package kafka_test

import (
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/IBM/sarama"

	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/classifytest"
	"github.com/fencedoutbox/watermill-outbox/transport/kafka"
)

// Every code docs/ERRORS.md promises for Kafka, checked on the error values
// sarama returns, bare and wrapped the way watermill-kafka wraps them.
func TestClassifyGivesTheDocumentedCodes(t *testing.T) {
	classifytest.Check(t, kafka.Classify, "cannot produce message m1: %w", []classifytest.Case{
		// Failed: the broker refuses the record for good (protocol names).
		{"message too large", sarama.ErrMessageSizeTooLarge, classifytest.Rejected("KAFKA_MESSAGE_TOO_LARGE")},
		{"unknown topic", sarama.ErrUnknownTopicOrPartition, classifytest.Rejected("KAFKA_UNKNOWN_TOPIC_OR_PARTITION")},
		{"topic authorization", sarama.ErrTopicAuthorizationFailed, classifytest.Rejected("KAFKA_TOPIC_AUTHORIZATION_FAILED")},
		{"record list too large", sarama.ErrMessageSetSizeTooLarge, classifytest.Rejected("KAFKA_RECORD_LIST_TOO_LARGE")},
		{"invalid topic", sarama.ErrInvalidTopic, classifytest.Rejected("KAFKA_INVALID_TOPIC_EXCEPTION")},
		{"invalid record", sarama.ErrInvalidRecord, classifytest.Rejected("KAFKA_INVALID_RECORD")},
		{"invalid timestamp", sarama.ErrInvalidTimestamp, classifytest.Rejected("KAFKA_INVALID_TIMESTAMP")},
		{"cluster authorization", sarama.ErrClusterAuthorizationFailed, classifytest.Rejected("KAFKA_CLUSTER_AUTHORIZATION_FAILED")},
		{"policy violation", sarama.ErrPolicyViolation, classifytest.Rejected("KAFKA_POLICY_VIOLATION")},
		{"in a producer error", &sarama.ProducerError{Msg: &sarama.ProducerMessage{Topic: "orders"}, Err: sarama.ErrMessageSizeTooLarge},
			classifytest.Rejected("KAFKA_MESSAGE_TOO_LARGE")},
		// Unavailable: the record was not appended.
		{"broker not available", sarama.ErrBrokerNotAvailable, classifytest.Unavailable("KAFKA_BROKER_NOT_AVAILABLE")},
		{"leader not available", sarama.ErrLeaderNotAvailable, classifytest.Unavailable("KAFKA_LEADER_NOT_AVAILABLE")},
		{"not enough replicas", sarama.ErrNotEnoughReplicas, classifytest.Unavailable("KAFKA_NOT_ENOUGH_REPLICAS")},
		{"storage error", sarama.ErrKafkaStorageError, classifytest.Unavailable("KAFKA_KAFKA_STORAGE_ERROR")},
		{"replica not available", sarama.ErrReplicaNotAvailable, classifytest.Unavailable("KAFKA_REPLICA_NOT_AVAILABLE")},
		// No broker: the record never left the client.
		{"out of brokers", sarama.ErrOutOfBrokers, classifytest.Unavailable("KAFKA_NO_BROKER")},
		{"not connected", sarama.ErrNotConnected, classifytest.Unavailable("KAFKA_NO_BROKER")},
		{"client closed", sarama.ErrClosedClient, classifytest.Unavailable("KAFKA_NO_BROKER")},
		// Any other Kafka error code: ambiguous, by number.
		{"not leader", sarama.ErrNotLeaderForPartition, classifytest.Ambiguous("KAFKA_ERROR_6")},
		{"request timed out", sarama.ErrRequestTimedOut, classifytest.Ambiguous("KAFKA_ERROR_7")},
		{"network exception", sarama.ErrNetworkException, classifytest.Ambiguous("KAFKA_ERROR_13")},
		{"not enough replicas after append", sarama.ErrNotEnoughReplicasAfterAppend, classifytest.Ambiguous("KAFKA_ERROR_20")},
		// sarama refused the record before sending.
		{"over MaxMessageBytes", sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 2000 > 1000"),
			classifytest.Rejected("KAFKA_CLIENT_REFUSED")},
		// Nothing with a Kafka code.
		{"eof", io.EOF, classifytest.Ambiguous("KAFKA_UNKNOWN")},
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, classifytest.Ambiguous("KAFKA_UNKNOWN")},
		{"i/o timeout is not a context deadline", &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, classifytest.Ambiguous("KAFKA_UNKNOWN")},
	})
}
