package envelope_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// The package doc (issue 21): producer defaults to Options.Producer, which is
// empty unless the caller sets it; it does not default to anything else.
func TestProducerDefaultsToOptionsProducerOnly(t *testing.T) {
	r := envelope.Row{MessageID: "id", Destination: "t", Status: envelope.StatusPending}
	back, err := envelope.ToMessage(r, envelope.Options{})
	require.NoError(t, err)
	require.Empty(t, back.Metadata.Get(envelope.KeyProducer))
}
