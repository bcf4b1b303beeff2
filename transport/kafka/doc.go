// Package kafka connects the outbox relay to Apache Kafka through
// watermill-kafka (IBM/sarama underneath).
//
// [NewPublisher] builds the downstream publisher for the forwarder. Its
// marshaler keeps what the outbox promises:
//
//   - the record key is the routing key: msg.partition_key when set, else the
//     message UUID, the same rule as the routing_key column, so every message
//     of one partition key lands on one partition (sarama's hash partitioner)
//     and keeps its order there;
//   - the UUID travels in watermill-kafka's "_watermill_message_uuid" header
//     and every metadata entry (canonical msg.* keys included) as a record
//     header, so a watermill-kafka subscriber gets the same message back.
//
// A confirm is a confirm: the producer waits for all in-sync replicas
// (RequiredAcks = WaitForAll). Topics are not auto-created unless
// Config.AllowAutoTopicCreation is set.
//
// [Classify] decides the row's fate from sarama's errors. Rejections (the
// broker refuses this record for good; the row is parked FAILED, redrivable):
// MESSAGE_TOO_LARGE, RECORD_LIST_TOO_LARGE, INVALID_TOPIC_EXCEPTION,
// INVALID_RECORD, INVALID_TIMESTAMP, TOPIC/CLUSTER_AUTHORIZATION_FAILED,
// POLICY_VIOLATION, UNSUPPORTED_FOR_MESSAGE_FORMAT, INVALID_REQUIRED_ACKS, a
// record larger than the producer's own MaxMessageBytes (refused by sarama
// before sending), and UNKNOWN_TOPIC_OR_PARTITION.
//
// UNKNOWN_TOPIC_OR_PARTITION is retriable in the Kafka protocol (the topic
// may be being created). It is a rejection here because it reaches the
// classifier only after sarama has refreshed metadata and retried
// (Producer.Retry.Max times), and with auto-creation off a missing topic is a
// configuration mistake the operator must see, not something a later retry
// fixes by itself. Fix the topic, then redrive the FAILED rows.
//
// No broker to send to (out of brokers, not connected, closed client) and
// answers that say the record was not appended (BROKER_NOT_AVAILABLE,
// LEADER_NOT_AVAILABLE, NOT_ENOUGH_REPLICAS,
// KAFKA_STORAGE_ERROR, REPLICA_NOT_AVAILABLE) are unavailable: no attempt
// spent, the destination's breaker counts them. Everything else (timeouts,
// NOT_LEADER_FOR_PARTITION, REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS_AFTER_APPEND,
// NETWORK_EXCEPTION (the broker may have appended before the connection
// dropped),
// cancelled contexts) is ambiguous: the record may have been written, the row
// is retried under the same id.
package kafka
