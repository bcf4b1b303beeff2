package publisher_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// newSchema gives each test its own migrated schema with a small pool: the
// PostgreSQL server is shared with other packages' tests.
func newSchema(t *testing.T) *testdb.Schema { return newSchemaB(t) }

func newSchemaB(t testing.TB) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(6)
	return s
}

// begin starts a transaction that is rolled back at cleanup unless the test
// finished it (Rollback after Commit is a harmless ErrTxDone).
func begin(t *testing.T, db *sql.DB, opts *sql.TxOptions) *sql.Tx {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

func randomID(t testing.TB) string {
	b := make([]byte, 8)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return hex.EncodeToString(b)
}

func newMsg(t testing.TB, payload string) *message.Message {
	return message.NewMessage("id-"+randomID(t), []byte(payload))
}

// readRow reads one stored row back with the envelope's own column list.
func readRow(t *testing.T, db *sql.DB, id string) envelope.Row {
	t.Helper()
	r, err := envelope.ScanRow(db.QueryRow(`SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id = $1`, id))
	require.NoError(t, err)
	return r
}

func msgs(t testing.TB, n int) []*message.Message {
	out := make([]*message.Message, n)
	for i := range out {
		out[i] = newMsg(t, "m")
	}
	return out
}
