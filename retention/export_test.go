package retention

import (
	"context"
	"database/sql"
)

// SetBeforeCommit installs a hook that runs inside each batch transaction,
// after its delete and before its commit, so a test can hold a batch open
// and look at the transaction's settings.
func SetBeforeCommit(c *Config, f func(ctx context.Context, tx *sql.Tx, b Batch) error) {
	c.beforeCommit = f
}

// Statements exposes the batch statements for EXPLAIN tests.
var Statements = map[string]string{
	"published":         sqlDeletePublished,
	"stream":            sqlDeleteStream,
	"parked":            sqlDeleteParked,
	"archive-published": sqlArchivePublished,
	"archive-stream":    sqlArchiveStream,
	"archive-parked":    sqlArchiveParked,
	"inbox":             sqlDeleteInbox,
}

// FirstYoungSeq exposes the stream bound's query for EXPLAIN tests.
const FirstYoungSeq = sqlFirstYoungSeq
