// Package natstest sets up JetStream streams for the NATS tests.
package natstest

import (
	"errors"
	"testing"

	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

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
