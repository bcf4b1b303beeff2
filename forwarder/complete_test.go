package forwarder_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// A pass may publish for up to LeaseDuration - 1.5 x PublishTimeout, far
// longer than the timeout of one statement: the outcome write must get its
// own timeout, not the one the claim started.
func TestOutcomesOfAPassLongerThanTheStatementTimeoutAreWritten(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	const stmt = 100 * time.Millisecond
	// The publish itself is what takes long here (4 statement timeouts), so
	// waiting on a timer is the scenario, not a guess.
	var f *forwarder.Forwarder
	slow := &recorder{behave: func(string, *message.Message) (bool, error) {
		// The claim is done: from here on every statement gets stmt (the
		// claim itself keeps the default, so a busy machine cannot time
		// it out).
		forwarder.SetDBTimeout(f, stmt)
		<-time.After(4 * stmt)
		return true, nil
	}}
	f = newForwarder(t, s.DB, slow, forwarder.Config{PublishTimeout: 5 * time.Second})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m1").Status)
}
