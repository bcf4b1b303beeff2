// Package brokertest holds the test helpers shared by the transport tests and
// outboxctl's relay end-to-end tests: finding a local RabbitMQ or NATS server
// (skipping the test, with a message naming the missing server, when nothing
// answers) and unique broker names. JetStream stream setup is in natstest,
// the in-process Kafka (kfake) and reading a topic back with a plain sarama
// consumer in kafkatest: each transport's module requires only its own
// broker's client.
//
// It is for tests only; nothing outside _test.go files should import it.
package brokertest

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"net"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
	u, err := url.Parse(uri)
	require.NoError(t, err)
	require.Contains(t, []string{"amqp", "amqps"}, u.Scheme, "%s must be an amqp:// or amqps:// URI", AMQPURLEnv)
	port := u.Port()
	if port == "" {
		port = map[string]string{"amqp": "5672", "amqps": "5671"}[u.Scheme]
	}
	skipUnlessListening(t, "RabbitMQ", net.JoinHostPort(cmp.Or(u.Hostname(), "localhost"), port), AMQPURLEnv)
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

// Unique returns prefix followed by a random suffix, for broker objects
// (exchanges, subjects, streams) that outlive a failed test or are shared
// by concurrent runs against one server.
func Unique(prefix string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}
