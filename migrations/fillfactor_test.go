package migrations_test

import (
	"context"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/migrations"
)

// Migration 00031 sets messaging_outbox's fillfactor to 50, the value the
// HOT-claim measurements stand on (fencing's TestClaimHOTShareFollowsFillfactor
// runs at the default); its Down puts back 00030's 70.
func TestFillfactorIsFiftyAndDownRestoresSeventy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, dsn := freshSchema(t)
	db := open(t, dsn)
	_, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	options := func() []string {
		var opts []string
		require.NoError(t, db.QueryRow(`SELECT coalesce(reloptions, '{}') FROM pg_class
 WHERE oid = to_regclass(current_schema() || '.messaging_outbox')`).Scan(pq.Array(&opts)))
		return opts
	}
	require.Equal(t, []string{"fillfactor=50"}, options())

	p := gooseProvider(t, db)
	_, err = p.DownTo(ctx, 30)
	require.NoError(t, err)
	require.Equal(t, []string{"fillfactor=70"}, options())
}
