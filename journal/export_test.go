package journal

// SetAfterRead installs a hook Begin calls between reading a conflicting row
// and its conditional takeover UPDATE.
func SetAfterRead(j *Journal, f func()) { j.afterRead = f }

// Statements exposes the batch statements for EXPLAIN tests.
var Statements = map[string]string{"redrive": sqlRedriveBatch, "purge": sqlPurgeBatch}

// FilterArgs exposes the bound filter parameters ($1..$7).
func FilterArgs(f Filter) []any { return f.args() }
