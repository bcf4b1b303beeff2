package kafka_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/transport/kafka"
)

func TestClassifyAmbiguous(t *testing.T) {
	require.Equal(t, forwarder.Confirmed, kafka.Classify(nil).Outcome)
	for _, err := range []error{
		sarama.ErrNotLeaderForPartition, sarama.ErrRequestTimedOut, sarama.ErrNotEnoughReplicasAfterAppend, context.DeadlineExceeded,
	} {
		require.Equal(t, forwarder.Ambiguous, kafka.Classify(err).Outcome, "%v", err)
		require.NotEmpty(t, kafka.Classify(err).Code)
	}
}

// Errors that say no broker could take the record at all: unavailable (no
// attempt spent; the destination's breaker opens).
func TestClassifyUnavailable(t *testing.T) {
	for _, err := range []error{
		sarama.ErrOutOfBrokers, sarama.ErrClosedClient, fmt.Errorf("dial: %w", sarama.ErrNotConnected),
		sarama.ErrBrokerNotAvailable, sarama.ErrLeaderNotAvailable, sarama.ErrNotEnoughReplicas,
	} {
		v := kafka.Classify(err)
		require.Equal(t, forwarder.Unavailable, v.Outcome, "%v", err)
		require.NotEmpty(t, v.Code)
	}
}

func TestConfigValidation(t *testing.T) {
	for _, cfg := range []kafka.Config{
		{},
		{Brokers: []string{""}},
		{Brokers: []string{"127.0.0.1:1"}, Sarama: sarama.NewConfig()}, // Return.Successes off
	} {
		_, err := kafka.NewPublisher(cfg, nil)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		require.True(t, strings.Contains(err.Error(), "kafka.Config"))
	}
}
