package journal

import (
	"encoding/json"
	"slices"
	"time"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Filter selects parked rows for Redrive and Purge. Empty fields do not
// filter; all set fields must match.
type Filter struct {
	// Statuses is a subset of FAILED and EXHAUSTED; empty means both. Any
	// other status is refused (JOURNAL_INVALID_FILTER): these operations
	// touch parked rows only.
	Statuses      []envelope.Status `json:"statuses"`
	Destination   string            `json:"destination,omitempty"`
	Tenant        string            `json:"tenant,omitempty"`
	FailureCode   string            `json:"failure_code,omitempty"`
	MessageIDs    []string          `json:"message_ids,omitempty"`
	CreatedAfter  time.Time         `json:"created_after"`  // created_at >= CreatedAfter
	CreatedBefore time.Time         `json:"created_before"` // created_at < CreatedBefore
}

// MarshalJSON writes the filter with zero times left out, the same bytes
// whatever the Go toolchain (the "omitzero" tag option only exists from Go
// 1.24, and this module builds with Go 1.23): plan digests are computed over
// this encoding and compared across processes.
func (f Filter) MarshalJSON() ([]byte, error) {
	type plain Filter // the fields and their tags, without this method
	// The outer fields shadow plain's of the same names and keep their place
	// (last), so only the zero times differ from plain's encoding.
	return json.Marshal(struct {
		plain
		CreatedAfter  *time.Time `json:"created_after,omitempty"`
		CreatedBefore *time.Time `json:"created_before,omitempty"`
	}{plain(f), nonZero(f.CreatedAfter), nonZero(f.CreatedBefore)})
}

func nonZero(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// Normalize returns the canonical form the digest is computed over: statuses
// defaulted, sorted and de-duplicated, message ids sorted and de-duplicated,
// times in UTC. Two filters that select the same rows by the same criteria
// written differently have the same digest.
func (f Filter) Normalize() Filter {
	n := f
	if len(n.Statuses) == 0 {
		n.Statuses = []envelope.Status{envelope.StatusExhausted, envelope.StatusFailed}
	} else {
		n.Statuses = slices.Clone(n.Statuses)
		slices.Sort(n.Statuses)
		n.Statuses = slices.Compact(n.Statuses)
	}
	if len(n.MessageIDs) > 0 {
		n.MessageIDs = slices.Clone(n.MessageIDs)
		slices.Sort(n.MessageIDs)
		n.MessageIDs = slices.Compact(n.MessageIDs)
	}
	if !n.CreatedAfter.IsZero() {
		n.CreatedAfter = n.CreatedAfter.UTC()
	}
	if !n.CreatedBefore.IsZero() {
		n.CreatedBefore = n.CreatedBefore.UTC()
	}
	return n
}

// Validate refuses filters these operations must not run
// (JOURNAL_INVALID_FILTER).
func (f Filter) Validate() error {
	const op = "journal.Filter.Validate"
	for _, s := range f.Statuses {
		if !s.Parked() {
			return outbox.Errorf(CodeInvalidFilter, op, "status %q is not parked; redrive and purge touch only FAILED and EXHAUSTED rows", s)
		}
	}
	if slices.Contains(f.MessageIDs, "") {
		return outbox.Errorf(CodeInvalidFilter, op, "an empty message id")
	}
	if !f.CreatedAfter.IsZero() && !f.CreatedBefore.IsZero() && !f.CreatedAfter.Before(f.CreatedBefore) {
		return outbox.Errorf(CodeInvalidFilter, op, "CreatedAfter %s is not before CreatedBefore %s: the range is empty",
			f.CreatedAfter.Format(time.RFC3339Nano), f.CreatedBefore.Format(time.RFC3339Nano))
	}
	return nil
}

// bind returns the statement parameters ($1..$7) of a normalized filter
// (see prepare, which computes them once per call for all its statements).
func (f Filter) bind() []any {
	statuses := make([]string, len(f.Statuses))
	for i, s := range f.Statuses {
		statuses[i] = string(s)
	}
	var ids any // NULL: no id filter
	if len(f.MessageIDs) > 0 {
		ids = pq.Array(f.MessageIDs)
	}
	return []any{pq.Array(statuses), nullString(f.Destination), nullString(f.Tenant), nullString(f.FailureCode),
		ids, nullTime(f.CreatedAfter), nullTime(f.CreatedBefore), nil, nil}
}

func nullString(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

// filterWhere is the filter as SQL over $1..$7 (see Filter.args), bounded
// by an approval's row set over $8 (highest seq) and $9 (parked before);
// $10 is the keyset cursor. A NULL parameter does not filter. "parked_at IS NOT NULL" is
// the predicate of messaging_outbox_parked_idx (parked_at is set exactly when
// status is FAILED or EXHAUSTED, a table CHECK), so the walk reads parked rows
// only.
const filterWhere = `
       parked_at IS NOT NULL AND status = ANY($1::text[]) AND status IN ('FAILED', 'EXHAUSTED')
   AND ($2::text IS NULL OR destination = $2)
   AND ($3::text IS NULL OR tenant = $3)
   AND ($4::text IS NULL OR last_failure_code = $4)
   AND ($5::text[] IS NULL OR message_id = ANY($5::text[]))
   AND ($6::timestamptz IS NULL OR created_at >= $6)
   AND ($7::timestamptz IS NULL OR created_at < $7)
   AND ($8::bigint IS NULL OR seq <= $8)
   AND ($9::timestamptz IS NULL OR parked_at < $9)`
