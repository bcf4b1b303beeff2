package migrations_test

import (
	"context"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// Migration 00034: an empty ordering key is no key. Rows that had one keep
// their place as unkeyed rows, and SQL that writes one is refused (23514)
// instead of being walked as a key by the claim and published as unkeyed.
func TestEmptyOrderingKeyBecomesNoKeyAndIsRefused(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	p := gooseProvider(t, s.DB)
	_, err := p.DownTo(ctx, 33)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key) VALUES ('e1', 'd', 'x', ''), ('k1', 'd', 'x', 'k')`)
	require.NoError(t, err)
	_, err = migrations.Up(ctx, s.DB)
	require.NoError(t, err)
	var nulls int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE message_id = 'e1' AND ordering_key IS NULL`).Scan(&nulls))
	require.Equal(t, 1, nulls)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key) VALUES ('e2', 'd', 'x', '')`)
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, "23514", string(pqErr.Code))
	require.Equal(t, "messaging_outbox_ordering_key_check", pqErr.Constraint)
}
