package status

import (
	"time"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Group is one (status, destination, tenant) slice of the unpublished rows.
type Group struct {
	Status      envelope.Status `json:"status"`
	Destination string          `json:"destination"`
	Tenant      string          `json:"tenant,omitempty"` // "" = no tenant
	Count       int64           `json:"count"`
	Oldest      time.Time       `json:"oldest_created_at"`
}

// Count is a labelled total.
type Count struct {
	Key   string `json:"key"`
	Count int64  `json:"count"`
}

// FailureCode is how many rows of a status carry a last_failure_code.
type FailureCode struct {
	Status envelope.Status `json:"status"`
	Code   string          `json:"code"` // "" = no code recorded
	Count  int64           `json:"count"`
}

// StuckCorrelation is a correlation id with parked rows or rows unpublished
// for longer than Options.StuckAfter.
type StuckCorrelation struct {
	CorrelationID string    `json:"correlation_id"`
	Parked        int64     `json:"parked"`       // FAILED + EXHAUSTED
	LongPending   int64     `json:"long_pending"` // PENDING, IN_FLIGHT, AMBIGUOUS past the threshold
	Oldest        time.Time `json:"oldest_created_at"`
}

// Relay is a relay with a live heartbeat: a polling relay (in
// Snapshot.Relays) or a CDC consumer (in Snapshot.CDCConsumers, with its
// slot).
type Relay struct {
	Owner       string    `json:"owner"`
	StartedAt   time.Time `json:"started_at"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
	ExpiresAt   time.Time `json:"expires_at"`
	SlotName    string    `json:"slot_name,omitempty"`
	// MaxAttempts is a polling relay's attempt budget, from its heartbeat
	// (0: not reported).
	MaxAttempts int `json:"max_attempts,omitempty"`
}

// Snapshot is everything `outboxctl status` shows, read in one read-only
// repeatable-read transaction, so the numbers agree with each other.
type Snapshot struct {
	At            time.Time `json:"at"` // the clock the snapshot was taken by
	Mode          string    `json:"relay_mode"`
	ModeChangedAt time.Time `json:"relay_mode_changed_at"`
	ModeChangedBy string    `json:"relay_mode_changed_by"`

	Unpublished   int64   `json:"unpublished"` // every non-PUBLISHED row
	ByStatus      []Count `json:"by_status"`
	ByDestination []Count `json:"by_destination"`
	ByTenant      []Count `json:"by_tenant"` // key "" = no tenant
	Groups        []Group `json:"groups"`
	Truncated     bool    `json:"truncated"` // Groups hit Options.MaxGroups; totals cover only what was read

	// Pending counts rows still on their way: PENDING, IN_FLIGHT, AMBIGUOUS.
	Pending                 int64     `json:"pending"`
	OldestPendingAt         time.Time `json:"oldest_pending_created_at"` // zero when nothing is pending
	OldestPendingAgeSeconds float64   `json:"oldest_pending_age_seconds"`

	Ambiguous         int64              `json:"ambiguous"`
	Failed            int64              `json:"failed"`
	Exhausted         int64              `json:"exhausted"`
	FailureCodes      []FailureCode      `json:"failure_codes"`
	StuckAfterSeconds float64            `json:"stuck_after_seconds"`
	StuckCorrelations []StuckCorrelation `json:"stuck_correlations"`
	// StuckTotal counts every stuck correlation id; more than
	// len(StuckCorrelations) when Options.MaxStuck cut the list.
	StuckTotal int64   `json:"stuck_total"`
	Relays     []Relay `json:"live_relays"`
	// BudgetsDiffer is true when live relays report different MaxAttempts:
	// the budget is each relay's configuration, so the lowest parks the
	// others' rows EXHAUSTED.
	BudgetsDiffer bool `json:"budgets_differ"`
	// Breakers are the open breakers of live relays: destinations a relay
	// found unavailable as a whole (their rows wait without spending
	// attempts while it probes).
	Breakers []Breaker `json:"open_breakers"`

	// Fence is the fleet's fence scheme (ROWS or LANES), and Lanes every
	// lane with its owner, epoch and what it holds in flight (all owned
	// by nobody under ROWS).
	Fence string `json:"fence"`
	Lanes []Lane `json:"lanes"`

	// CDCConsumers are the CDC consumers with a live heartbeat (native
	// relays, Debezium connectors through their heartbeat action query).
	CDCConsumers []Relay `json:"cdc_consumers"`
	// Slots are the logical replication slots of this database.
	Slots []Slot `json:"replication_slots"`
	// Warnings are conditions an operator must act on: CDC consumers on
	// more than one slot (each delivers every insert), a CDC consumer live
	// outside CDC mode, a slot that is lost or unreserved.
	Warnings []string `json:"warnings"`
}

// Breaker is a live relay's open breaker.
type Breaker struct {
	Owner       string    `json:"owner"`
	Destination string    `json:"destination"`
	OpenedAt    time.Time `json:"opened_at"`
	LastError   string    `json:"last_error"`
}
