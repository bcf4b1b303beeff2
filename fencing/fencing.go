package fencing

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Codes returned by this package.
const (
	// CodeInvalidArgument: a claim or an outcome that cannot be executed as
	// given (empty owner, non-positive limit, unknown target state, the same
	// row twice in one batch).
	CodeInvalidArgument outbox.Code = "FENCING_INVALID_ARGUMENT"
	// CodeLeaseExpired is written to last_failure_code when a claim finds a
	// row whose lease expired before its holder wrote an outcome.
	CodeLeaseExpired = "LEASE_EXPIRED"
	// CodeBudgetSpent is written to last_failure_code when a claim finds a
	// PENDING or AMBIGUOUS row whose attempts already reach the budget (the
	// budget was lowered after they were spent) and parks it EXHAUSTED; the
	// detail keeps the code it had before.
	CodeBudgetSpent = "BUDGET_SPENT"
)

// ErrInvalidArgument matches CodeInvalidArgument with errors.Is.
var ErrInvalidArgument = &outbox.Error{Code: CodeInvalidArgument}

// MaxFailureDetail bounds last_failure_detail in bytes; longer text is cut at
// a rune boundary so a broker's multi-kilobyte error page cannot bloat rows.
const MaxFailureDetail = 1024

// DBTX is satisfied by *sql.DB, *sql.Tx and *sql.Conn.
type DBTX interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Lease is a relay's right to write the outcome of one row: valid while the
// row is IN_FLIGHT with this owner and token.
//
// A lease held through a lane (Lanes > 0, from a claim with
// [ClaimParams].Lanes) is valid while the row's lane is still Owner's at
// epoch Token and the row still has Attempts: nothing of it is written on the
// row, and ExpiresAt is the lane's lease.
type Lease struct {
	MessageID string
	Owner     string
	Token     int64
	ExpiresAt time.Time
	// Lanes is the lane count of the table the lease was taken from, for a
	// lease held through a lane; 0 for a per-row lease.
	Lanes int
	// Attempts is the row's attempts when a lane lease was taken.
	Attempts int
}

// OrderingPolicy says whether a parked row holds back later rows of its
// ordering key.
type OrderingPolicy int

const (
	// BlockKey (the default): a FAILED or EXHAUSTED row blocks every later row
	// with the same ordering key until it is redriven and published, or
	// purged. No later row of the key overtakes a parked one; purging the
	// parked row does leave a gap in what consumers see.
	BlockKey OrderingPolicy = iota
	// SkipParked: parked rows do not block their key; later rows are published
	// and the parked one, if redriven, arrives out of order.
	SkipParked
)

func (p OrderingPolicy) String() string {
	switch p {
	case BlockKey:
		return "block-key"
	case SkipParked:
		return "skip-parked"
	}
	return fmt.Sprintf("OrderingPolicy(%d)", int(p))
}

// Valid reports whether p is one of the declared policies.
func (p OrderingPolicy) Valid() bool { return p == BlockKey || p == SkipParked }
