package inbox_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/spanrec"
)

// messaging.message.conversation_id is msg.correlation_id, else watermill's
// correlation_id (set by its CorrelationID middleware), else absent.
func TestTraceConversationIDFallsBackToWatermillsCorrelationID(t *testing.T) {
	rec := spanrec.New()
	h := inbox.TraceMiddleware(inbox.TraceConfig{TracerProvider: rec})(func(*message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	conversation := func(m *message.Message) (any, bool) {
		t.Helper()
		_, err := h(m)
		require.NoError(t, err)
		ended := rec.Ended()
		v, ok := ended[len(ended)-1].Attr("messaging.message.conversation_id")
		return v.AsInterface(), ok
	}

	watermillOnly := message.NewMessage("wm", nil)
	watermillOnly.Metadata.Set(envelope.WatermillCorrelationKey, "wm-corr") // what middleware.SetCorrelationID sets
	v, ok := conversation(watermillOnly)
	require.True(t, ok, "watermill's key alone is used")
	require.Equal(t, "wm-corr", v)

	both := message.NewMessage("both", nil)
	both.Metadata.Set(envelope.WatermillCorrelationKey, "wm-corr")
	both.Metadata.Set(envelope.KeyCorrelationID, "outbox-corr")
	v, ok = conversation(both)
	require.True(t, ok)
	require.Equal(t, "outbox-corr", v, "msg.correlation_id wins")

	_, ok = conversation(message.NewMessage("none", nil))
	require.False(t, ok, "no correlation id, no attribute")
}
