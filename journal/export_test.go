package journal

import (
	"context"
	"database/sql"
)

// SetAfterRead installs a hook Begin calls between reading a conflicting row
// and its conditional takeover UPDATE.
func SetAfterRead(j *Journal, f func()) { j.afterRead = f }

// SetBeforeCommit installs a hook a batch calls with its transaction done
// but not committed: a test can freeze an executor there.
func SetBeforeCommit(j *Journal, f func()) { j.beforeCommit = f }

// CheckpointTx runs j's checkpoint statement for run inside tx, as a batch
// does, so a test can hold a checkpoint uncommitted while another owner acts.
func CheckpointTx(ctx context.Context, j *Journal, tx *sql.Tx, run *Run, items int64, cursor string) error {
	return j.checkpoint(ctx, tx, run, items, cursor)
}

// Statements exposes the batch statements for EXPLAIN tests.
var Statements = map[string]string{"redrive": sqlRedriveBatch, "purge": sqlPurgeBatch}

// FilterArgs exposes the bound filter parameters ($1..$7).
func FilterArgs(f Filter) []any { return f.Normalize().bind() }
