// Package brokertest holds the test helpers shared by the transport tests and
// outboxctl's relay end-to-end tests: finding a local RabbitMQ or NATS server
// (skipping the test, with a message naming the missing server, when nothing
// answers), JetStream stream setup, an in-process Kafka (kfake), reading a
// Kafka topic back with a plain sarama consumer, and unique broker names.
//
// It is for tests only; nothing outside _test.go files should import it.
package brokertest

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net"
	"net/url"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	wk "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	natsgo "github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
)

// Environment variables naming the test brokers, and their defaults (the
// servers `make services` starts).
const (
	AMQPURLEnv     = "OUTBOX_TEST_AMQP_URL"
	DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"
	NATSURLEnv     = "OUTBOX_TEST_NATS_URL"
	DefaultNATSURL = "nats://127.0.0.1:4222"
)

// dialTimeout bounds the reachability check: a local server answers at once,
// and a test should not hang on a firewall that drops packets.
const dialTimeout = time.Second

// AMQPURL returns the RabbitMQ URI, skipping the test when nothing answers.
func AMQPURL(t testing.TB) string {
	t.Helper()
	uri := cmp.Or(os.Getenv(AMQPURLEnv), DefaultAMQPURL)
	u, err := amqp091.ParseURI(uri)
	require.NoError(t, err)
	skipUnlessListening(t, "RabbitMQ", net.JoinHostPort(u.Host, strconv.Itoa(u.Port)), AMQPURLEnv)
	return uri
}

// NATSURL returns the NATS URL, skipping the test when nothing answers.
func NATSURL(t testing.TB) string {
	t.Helper()
	u := cmp.Or(os.Getenv(NATSURLEnv), DefaultNATSURL)
	parsed, err := url.Parse(u)
	require.NoError(t, err)
	skipUnlessListening(t, "NATS (JetStream)", parsed.Host, NATSURLEnv)
	return u
}

// skipUnlessListening skips the test, naming server and how to point the
// tests at one, when nothing accepts a TCP connection at addr.
func skipUnlessListening(t testing.TB, server, addr, env string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, dialTimeout)
	if err != nil {
		t.Skipf("%s is not reachable at %s (set %s or run `make services`): %v", server, addr, env, err)
	}
	_ = c.Close()
}

// JetStream creates an in-memory stream named subject capturing subject on
// the NATS server at u (maxMsgSize 0 means the server's limit), deleted at
// cleanup, and returns the JetStream context for reading it back. It skips
// the test when the server has JetStream disabled.
func JetStream(t testing.TB, u, subject string, maxMsgSize int32) natsgo.JetStreamContext {
	t.Helper()
	nc, err := natsgo.Connect(u)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	require.NoError(t, err)
	_, err = js.AddStream(&natsgo.StreamConfig{Name: subject, Subjects: []string{subject}, MaxMsgSize: maxMsgSize, Storage: natsgo.MemoryStorage})
	if errors.Is(err, natsgo.ErrJetStreamNotEnabled) {
		t.Skipf("NATS at %s has JetStream disabled (start nats-server with -js)", u)
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(subject) })
	return js
}

// Kafka starts an in-process one-broker Kafka (kfake: the real protocol, no
// broker to install) configured by opts, closed at cleanup, and returns its
// bootstrap addresses. Topics exist only when opts seed them: kfake does not
// create topics on demand unless told to.
func Kafka(t testing.TB, opts ...kfake.Opt) []string {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

// KafkaRecord is one record read back by [ReadKafka].
type KafkaRecord struct {
	Partition int32
	Key       string
	Value     []byte
	Headers   map[string]string
}

// UUID is the watermill message UUID the record carries in its headers.
func (r KafkaRecord) UUID() string { return r.Headers[wk.UUIDHeaderKey] }

// ReadKafka returns every record of topic, partition by partition in offset
// order, read by a plain sarama consumer up to each partition's high water
// mark as it stands when the partition is read.
func ReadKafka(t testing.TB, brokers []string, topic string) []KafkaRecord {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_1_0_0
	client, err := sarama.NewClient(brokers, cfg)
	require.NoError(t, err)
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	require.NoError(t, err)
	defer consumer.Close()
	parts, err := client.Partitions(topic)
	require.NoError(t, err)
	var out []KafkaRecord
	for _, p := range parts {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		if hwm == 0 {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		require.NoError(t, err)
		for done := false; !done; {
			select {
			case m := <-pc.Messages():
				r := KafkaRecord{Partition: p, Key: string(m.Key), Value: m.Value, Headers: map[string]string{}}
				for _, h := range m.Headers {
					r.Headers[string(h.Key)] = string(h.Value)
				}
				out = append(out, r)
				done = m.Offset+1 >= hwm
			case <-time.After(10 * time.Second):
				t.Fatalf("partition %d: no record before the high water mark %d", p, hwm)
			}
		}
		require.NoError(t, pc.Close())
	}
	return out
}

// Unique returns prefix followed by a random suffix, for broker objects
// (exchanges, subjects, streams) that outlive a failed test or are shared
// by concurrent runs against one server.
func Unique(prefix string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}
