package publisher_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// A Publisher not built by New, NewOnTx or InTx has no transaction: Publish
// refuses it with a code instead of dereferencing a nil *sql.Tx.
func TestZeroValuePublisherIsRefusedWithoutPanicking(t *testing.T) {
	var zero publisher.Publisher
	require.ErrorIs(t, zero.Publish("t", newMsg(t, "x")), outbox.ErrTransactionRequired)
	require.ErrorIs(t, zero.Publish("t", newMsg(t, "a"), newMsg(t, "b")), outbox.ErrTransactionRequired)
	require.ErrorIs(t, zero.Publish("t"), outbox.ErrTransactionRequired, "no messages: still no transaction")
	require.NoError(t, zero.Close())
	require.ErrorIs(t, zero.Publish("t", newMsg(t, "x")), outbox.ErrPublisherClosed)
}

// nilTx is a driver transaction whose methods have pointer receivers, so a
// nil *nilTx is a non-nil publisher.Tx.
type nilTx struct{}

func (*nilTx) Exec(context.Context, string, ...any) error { return nil }

func TestNewOnTxRefusesATypedNilTx(t *testing.T) {
	var tx *nilTx
	pub, err := publisher.NewOnTx(tx, publisher.Config{}, nil)
	require.ErrorIs(t, err, outbox.ErrTransactionRequired)
	require.Nil(t, pub)

	pub, err = publisher.NewOnTx(nil, publisher.Config{}, nil)
	require.ErrorIs(t, err, outbox.ErrTransactionRequired, "a plain nil too")
	require.Nil(t, pub)
}
