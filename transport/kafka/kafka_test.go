// These tests run against the in-process Kafka server kfake
// (github.com/twmb/franz-go/pkg/kfake): real Kafka protocol, no broker to install.
package kafka_test

import (
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	wk "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest/kafkatest"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/e2e"
	"github.com/fencedoutbox/watermill-outbox/transport/kafka"
)

const maxMessageBytes = 4096

// cluster starts an in-process Kafka with a 4-partition "orders" topic, auto
// creation off and a small message.max.bytes.
func cluster(t *testing.T) []string {
	t.Helper()
	return kafkatest.Start(t,
		kfake.SeedTopics(4, "orders"),
		kfake.BrokerConfigs(map[string]string{"message.max.bytes": fmt.Sprint(maxMessageBytes)}),
	)
}

func newPublisher(t *testing.T, brokers []string) *wk.Publisher {
	t.Helper()
	pub, err := kafka.NewPublisher(kafka.Config{Brokers: brokers}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func TestOneKeyLandsOnOnePartitionInOrder(t *testing.T) {
	brokers := cluster(t)
	pub := newPublisher(t, brokers)
	var sent []string
	for i := range 40 {
		msg := message.NewMessage(fmt.Sprintf("m-%02d", i), []byte(fmt.Sprint(i)))
		envelope.SetPartitionKey(msg, []string{"customer-a", "customer-b"}[i%2])
		require.NoError(t, pub.Publish("orders", msg))
		sent = append(sent, msg.UUID)
	}
	recs := kafkatest.Read(t, brokers, "orders")
	require.Len(t, recs, 40)
	partitionOf := map[string]int32{}
	perKey := map[string][]string{}
	for _, r := range recs {
		if p, ok := partitionOf[r.Key]; ok {
			require.Equal(t, p, r.Partition, "key %s on two partitions", r.Key)
		}
		partitionOf[r.Key] = r.Partition
		require.Equal(t, r.Key, r.Headers[envelope.KeyPartitionKey])
		perKey[r.Key] = append(perKey[r.Key], r.UUID())
	}
	require.Len(t, perKey, 2)
	for key, got := range perKey {
		var want []string
		for i, id := range sent {
			if []string{"customer-a", "customer-b"}[i%2] == key {
				want = append(want, id)
			}
		}
		require.Equal(t, want, got, "order of key %s", key)
	}
}

func TestRecordKeyFallsBackToUUID(t *testing.T) {
	brokers := cluster(t)
	pub := newPublisher(t, brokers)
	msg := message.NewMessage("no-key-id", []byte("x"))
	msg.Metadata.Set("h", "v")
	require.NoError(t, pub.Publish("orders", msg))
	recs := kafkatest.Read(t, brokers, "orders")
	require.Len(t, recs, 1)
	require.Equal(t, "no-key-id", recs[0].Key)
	require.Equal(t, "no-key-id", recs[0].UUID())
	require.Equal(t, "v", recs[0].Headers["h"])
	require.Equal(t, "no-key-id", kafka.RoutingKey(msg))
}

func TestBrokerRefusesTooLargeMessage(t *testing.T) {
	brokers := cluster(t)
	pub := newPublisher(t, brokers)
	err := pub.Publish("orders", message.NewMessage("big", make([]byte, 2*maxMessageBytes)))
	require.Error(t, err)
	v := kafka.Classify(err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: "KAFKA_MESSAGE_TOO_LARGE"}, v, "error: %v", err)
}

func TestClientRefusesRecordOverItsOwnLimit(t *testing.T) {
	brokers := cluster(t)
	sc := kafka.SaramaConfig(kafka.Config{})
	sc.Producer.MaxMessageBytes = 1024
	pub, err := kafka.NewPublisher(kafka.Config{Brokers: brokers, Sarama: sc}, nil)
	require.NoError(t, err)
	defer pub.Close()
	err = pub.Publish("orders", message.NewMessage("big", make([]byte, 2048)))
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: kafka.CodeClientRefused}, kafka.Classify(err), "error: %v", err)
}

func TestUnknownTopicWithAutoCreateOffIsRejected(t *testing.T) {
	brokers := cluster(t)
	pub := newPublisher(t, brokers)
	err := pub.Publish("no-such-topic", message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: "KAFKA_UNKNOWN_TOPIC_OR_PARTITION"}, kafka.Classify(err), "error: %v", err)
}

func TestInvalidTopicNameIsRejected(t *testing.T) {
	brokers := cluster(t)
	pub := newPublisher(t, brokers)
	err := pub.Publish("bad topic name!", message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	v := kafka.Classify(err)
	require.Equal(t, forwarder.Rejected, v.Outcome, "error: %v", err)
}

// The cluster gone (connection refused on every broker): the record never
// left the client, so the destination is unavailable as a whole, not the
// message ambiguous.
func TestBrokerGoneIsUnavailable(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(kafka.Config{Brokers: c.ListenAddrs()}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish("orders", message.NewMessage("m0", []byte("x"))))
	c.Close()
	// The first publish may still go out on the connection the client had
	// open and see it cut (EOF): the request may have reached the broker, so
	// that is ambiguous, rightly. Once the client has noticed, every broker
	// refuses the connection: unavailable.
	for i := range 20 {
		err = pub.Publish("orders", message.NewMessage(fmt.Sprintf("m%d", i+1), []byte("x")))
		require.Error(t, err)
		v := kafka.Classify(err).Outcome
		if v == forwarder.Unavailable {
			return
		}
		require.Equal(t, forwarder.Ambiguous, v, "error: %v", err)
	}
	t.Fatalf("the cluster is gone, yet no publish was classified unavailable; last error: %v", err)
}

func TestEndToEnd(t *testing.T) {
	brokers := cluster(t)
	pub := newPublisher(t, brokers)
	e2e.Relay(t, "orders", pub, kafka.Classify)

	recs := kafkatest.Read(t, brokers, "orders")
	var got []*message.Message
	for _, r := range recs {
		msg, err := kafka.Marshaler().Unmarshal(&sarama.ConsumerMessage{Key: []byte(r.Key), Value: r.Value, Headers: headers(r.Headers)})
		require.NoError(t, err)
		require.Equal(t, kafka.RoutingKey(msg), r.Key)
		got = append(got, msg)
	}
	e2e.Check(t, got)
}

func headers(h map[string]string) []*sarama.RecordHeader {
	var out []*sarama.RecordHeader
	for k, v := range h {
		out = append(out, &sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
	}
	return out
}

// transport/kafka/doc.go: a publish waits for every in-sync replica
// (RequiredAcks = WaitForAll), and a missing topic is created only with
// Config.AllowAutoTopicCreation (the broker must allow it too; the default
// refusal is TestUnknownTopicWithAutoCreateOffIsRejected).
func TestAcksFromAllReplicasAndAutoCreateWhenAllowed(t *testing.T) {
	require.Equal(t, sarama.WaitForAll, kafka.SaramaConfig(kafka.Config{}).Producer.RequiredAcks)

	brokers := kafkatest.Start(t, kfake.AllowAutoTopicCreation())
	pub, err := kafka.NewPublisher(kafka.Config{Brokers: brokers, AllowAutoTopicCreation: true}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	require.NoError(t, pub.Publish("fresh", message.NewMessage("m1", []byte("x"))))
	recs := kafkatest.Read(t, brokers, "fresh")
	require.Len(t, recs, 1)
}
