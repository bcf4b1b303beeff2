package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest/kafkatest"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// TestRelayToKafka runs the built relay against kfake, an in-process Kafka
// speaking the real protocol, with auto topic creation off.
func TestRelayToKafka(t *testing.T) {
	t.Parallel()
	brokers := kafkatest.Start(t, kfake.SeedTopics(2, "orders"))
	s := newSchema(t)
	testdb.InsertRows(t, s.DB,
		testdb.Row(envelope.Row{MessageID: "k-1", Destination: "orders", Payload: []byte("one"), Headers: map[string]string{"app": "shop"}, PartitionKey: "customer-1"}),
		testdb.Row(envelope.Row{MessageID: "k-2", Destination: "orders", Payload: []byte("two")}),
		testdb.Row(envelope.Row{MessageID: "k-missing", Destination: "no-such-topic", Payload: []byte("x")}))

	cmd, stderr := startRelay(t, s, nil, "--to", "kafka", "--kafka-brokers", strings.Join(brokers, ","))
	waitStatus(t, s, stderr, "k-1", "PUBLISHED")
	waitStatus(t, s, stderr, "k-2", "PUBLISHED")
	// kafka.Classify is the relay's classifier: a missing topic is a
	// rejection with the broker's error name (the default would retry it).
	waitStatus(t, s, stderr, "k-missing", "FAILED")
	require.Equal(t, "KAFKA_UNKNOWN_TOPIC_OR_PARTITION", failureCode(t, s, "k-missing"))

	got := map[string]kafkatest.Record{}
	for _, r := range kafkatest.Read(t, brokers, "orders") {
		got[r.UUID()] = r
	}
	require.Len(t, got, 2)
	require.Equal(t, "one", string(got["k-1"].Value))
	require.Equal(t, "customer-1", got["k-1"].Key, "record key is the partition key")
	require.Equal(t, "shop", got["k-1"].Headers["app"])
	require.Equal(t, "two", string(got["k-2"].Value))
	require.Equal(t, "k-2", got["k-2"].Key, "record key falls back to the UUID")

	stopRelay(t, cmd, stderr)
}

func TestRelayToKafkaBadBrokers(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	for _, tc := range []struct{ brokers, detail string }{
		{"", "at least one bootstrap address"},
		{" , ", "empty address"},
		{"127.0.0.1:9092,,127.0.0.1:9093", "empty address"},
		// Malformed addresses: refused before any dial, not a connection
		// failure (exit 1) after sarama's retries.
		{"nohostport", `"nohostport" is not host:port`},
		{"127.0.0.1:9092,broker:kafka", `"broker:kafka" is not host:port`},
		{":9092", `":9092" is not host:port`},
		{"h:0", `"h:0" is not host:port`},
	} {
		r := db(t, s, "relay", "--to", "kafka", "--kafka-brokers", tc.brokers)
		requireCode(t, r, 2)
		require.Contains(t, r.stderr, "code: OUTBOX_INVALID_CONFIG", "brokers %q", tc.brokers)
		require.Contains(t, r.stderr, tc.detail, "brokers %q", tc.brokers)
	}
}
