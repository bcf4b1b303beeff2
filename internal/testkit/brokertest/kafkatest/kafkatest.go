// Package kafkatest runs an in-process Kafka (kfake) and reads topics back
// with a plain sarama consumer, for the Kafka tests.
package kafkatest

import (
	"testing"
	"time"

	"github.com/IBM/sarama"
	wk "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
)

// Start starts an in-process one-broker Kafka (kfake: the real protocol, no
// broker to install) configured by opts, closed at cleanup, and returns its
// bootstrap addresses. Topics exist only when opts seed them: kfake does not
// create topics on demand unless told to.
func Start(t testing.TB, opts ...kfake.Opt) []string {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

// Record is one record read back by [Read].
type Record struct {
	Partition int32
	Key       string
	Value     []byte
	Headers   map[string]string
}

// UUID is the watermill message UUID the record carries in its headers.
func (r Record) UUID() string { return r.Headers[wk.UUIDHeaderKey] }

// Read returns every record of topic, partition by partition in offset
// order, read by a plain sarama consumer up to each partition's high water
// mark as it stands when the partition is read.
func Read(t testing.TB, brokers []string, topic string) []Record {
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
	var out []Record
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
				r := Record{Partition: p, Key: string(m.Key), Value: m.Value, Headers: map[string]string{}}
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
