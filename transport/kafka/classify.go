package kafka

import (
	"errors"
	"strconv"

	"github.com/IBM/sarama"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/outcome"
)

// Codes stored in last_failure_code by Classify for errors that are not a
// broker error code.
const (
	CodeClientRefused = "KAFKA_CLIENT_REFUSED" // sarama refused the record before sending (e.g. over Producer.MaxMessageBytes)
	CodeUnknown       = "KAFKA_UNKNOWN"
	CodeNoBroker      = "KAFKA_NO_BROKER" // no broker reachable (out of brokers, not connected, client closed)
)

// rejected names the broker error codes that refuse a record for good, by
// their protocol names.
var rejected = map[sarama.KError]string{
	sarama.ErrUnknownTopicOrPartition:            "UNKNOWN_TOPIC_OR_PARTITION",
	sarama.ErrMessageSizeTooLarge:                "MESSAGE_TOO_LARGE",
	sarama.ErrMessageSetSizeTooLarge:             "RECORD_LIST_TOO_LARGE",
	sarama.ErrInvalidTopic:                       "INVALID_TOPIC_EXCEPTION",
	sarama.ErrInvalidRecord:                      "INVALID_RECORD",
	sarama.ErrInvalidTimestamp:                   "INVALID_TIMESTAMP",
	sarama.ErrTopicAuthorizationFailed:           "TOPIC_AUTHORIZATION_FAILED",
	sarama.ErrClusterAuthorizationFailed:         "CLUSTER_AUTHORIZATION_FAILED",
	sarama.ErrTransactionalIDAuthorizationFailed: "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
	sarama.ErrPolicyViolation:                    "POLICY_VIOLATION",
	sarama.ErrUnsupportedForMessageFormat:        "UNSUPPORTED_FOR_MESSAGE_FORMAT",
	sarama.ErrInvalidRequiredAcks:                "INVALID_REQUIRED_ACKS",
}

// Broker answers that say the cluster could not take the record at all: it
// was not appended (NOT_ENOUGH_REPLICAS is refused before the append; the
// _AFTER_APPEND form is ambiguous and stays so).
var unavailable = map[sarama.KError]string{
	sarama.ErrBrokerNotAvailable:  "BROKER_NOT_AVAILABLE",
	sarama.ErrLeaderNotAvailable:  "LEADER_NOT_AVAILABLE",
	sarama.ErrNotEnoughReplicas:   "NOT_ENOUGH_REPLICAS",
	sarama.ErrKafkaStorageError:   "KAFKA_STORAGE_ERROR",
	sarama.ErrReplicaNotAvailable: "REPLICA_NOT_AVAILABLE",
}

// Classify is a forwarder.Classifier for Kafka publish errors: pass it as
// forwarder.Config.Classifier. The rules are in the package documentation.
func Classify(err error) forwarder.Verdict {
	if err == nil {
		return forwarder.Verdict{Outcome: forwarder.Confirmed}
	}
	switch {
	case errors.Is(err, sarama.ErrOutOfBrokers), errors.Is(err, sarama.ErrNotConnected), errors.Is(err, sarama.ErrClosedClient):
		// No broker to send to: the record never left the client.
		return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: CodeNoBroker}
	}
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		if name, ok := unavailable[kerr]; ok {
			return forwarder.Verdict{Outcome: forwarder.Unavailable, Code: "KAFKA_" + name}
		}
		if name, ok := rejected[kerr]; ok {
			return forwarder.Verdict{Outcome: forwarder.Rejected, Code: "KAFKA_" + name}
		}
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: "KAFKA_ERROR_" + strconv.Itoa(int(kerr))}
	}
	var cfgErr sarama.ConfigurationError
	if errors.As(err, &cfgErr) {
		// Raised by the producer for this record before anything was sent;
		// the same record is refused again.
		return forwarder.Verdict{Outcome: forwarder.Rejected, Code: CodeClientRefused}
	}
	if r, ok := outcome.Context(err); ok {
		return r
	}
	return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: CodeUnknown}
}

var _ forwarder.Classifier = Classify
