package cdcrelay

import (
	"cmp"
	"database/sql"
	"fmt"
	"math"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
)

// Defaults filled in by [Config] when a field is zero.
const (
	DefaultSchema            = "public"
	DefaultSlotName          = debezium.DefaultSlotName        // the Debezium connector's default too: one slot, one consumer
	DefaultPublicationName   = debezium.DefaultPublicationName // one insert-only publication serves both
	DefaultHeartbeatInterval = 2 * time.Second
	DefaultHeartbeatTTL      = 15 * time.Second
	DefaultBatchSize         = 256
	DefaultLagWarnBytes      = 1 << 30
	DefaultLagWarnEvery      = time.Minute
	DefaultStandbyTimeout    = 10 * time.Second
	DefaultRetryInitial      = 100 * time.Millisecond
	DefaultRetryMax          = 10 * time.Second
	DefaultSlotBusyWait      = 5 * time.Second
	DefaultDBTimeout         = 5 * time.Second
	DefaultDrainTimeout      = 10 * time.Second
)

// MaxStopTimeout is the largest DBTimeout and DrainTimeout [Config.Validate]
// accepts.
const MaxStopTimeout = time.Hour

// Config configures a [Relay]. Zero values are documented per field.
type Config struct {
	// ConnString is the replication connection (pgx/pgconn syntax, URL or
	// key=value). It must be a logical replication connection to the
	// outbox's database: replication=database is added when absent, and any
	// other replication value is refused. Required.
	ConnString string

	// DB is an ordinary pool on the same database whose search_path resolves
	// the outbox's schema (as for every other package of this module). The
	// relay reads the relay mode through it (relaymode.CurrentMode), and
	// checks and creates the publication and reads the slot's position.
	// Required.
	DB *sql.DB

	// Schema holding messaging_outbox. Zero means "public". Run refuses when
	// DB's current_schema() is a different schema: the relay would read one
	// schema's relay mode and stream another's inserts.
	Schema string

	// SlotName is the logical replication slot (pgoutput). Zero means
	// DefaultSlotName, which is also the Debezium connector's default: a slot
	// has one consumer at a time, so a relay and a connector started with
	// their defaults cannot both deliver (the second is refused with
	// CDC_SLOT_IN_USE). A relay on another slot while another CDC consumer's
	// heartbeat is live is refused with CDC_SECOND_CONSUMER.
	SlotName string

	// Owner names this relay in the CDC heartbeat (messaging_relay_heartbeat,
	// kind CDC). Zero means "cdcrelay@<hostname>:<pid>:<slot>".
	Owner string

	// HeartbeatInterval is how often the relay renews its CDC heartbeat
	// (relaymode.BeatCDC, which also re-reads the relay mode): at the first
	// publish or loop turn after it has passed. Zero means 2s.
	HeartbeatInterval time.Duration

	// HeartbeatTTL is how long one heartbeat keeps the relay registered, and
	// so how long `outboxctl debezium disable` refuses after the relay died
	// without removing it. The relay publishes only while its last
	// successful heartbeat is younger than HeartbeatTTL (measured from before
	// the heartbeat was sent, so it stops before the database lets the mode
	// change). It must be at least twice HeartbeatInterval. Zero means 15s.
	HeartbeatTTL time.Duration

	// BatchSize bounds how many inserts of one transaction the relay holds
	// before it publishes them: it reads their status in one query (rows
	// already PUBLISHED, e.g. by the forwarders before the switch to CDC, or
	// parked FAILED/EXHAUSTED, are skipped), publishes the rest in commit
	// order and marks them PUBLISHED in one statement. Zero means 256.
	BatchSize int

	// LagWarnBytes: the relay logs a warning when its slot retains more WAL
	// than this (checked with each heartbeat, logged at most every
	// LagWarnEvery), or when the slot's wal_status is "unreserved". Zero
	// means 1 GiB; negative disables the warning.
	LagWarnBytes int64
	LagWarnEvery time.Duration

	// PublicationName is the insert-only publication on messaging_outbox.
	// Zero means DefaultPublicationName.
	PublicationName string

	// CreateSlot lets Run create the slot when it is missing. Without it a
	// missing slot is CDC_SLOT_MISSING. See the package documentation for
	// when to create the slot (before the polling relays stop).
	CreateSlot bool

	// CreatePublication lets Run create the publication (debezium.PublicationSQL)
	// when it is missing. Without it a missing publication is
	// CDC_PUBLICATION_MISSING.
	CreatePublication bool

	// StandbyTimeout is the longest the relay stays silent towards the
	// server: it sends a status update (its confirmed position) at least this
	// often, and re-reads the relay mode at the first replication message
	// after it has passed (not while a refused publish is being retried; see
	// the package documentation). It must be well below the server's
	// wal_sender_timeout (60s by default). Zero means 10s.
	StandbyTimeout time.Duration

	// SlotBusyWait is how long Run waits for a slot that another consumer
	// holds to become free before it refuses with CDC_SLOT_IN_USE (a
	// restarted relay's previous session takes a moment to end on the
	// server). Zero means 5s.
	SlotBusyWait time.Duration

	// RetryInitial and RetryMax shape the exponential backoff between
	// attempts to publish a message the downstream refused. Zero means
	// 100ms and 10s. While it backs off the relay holds no replication
	// connection (see the package documentation: a refusing downstream never
	// blocks the server's shutdown).
	RetryInitial time.Duration
	RetryMax     time.Duration

	// DBTimeout bounds each statement and replication-protocol exchange a
	// stop waits for: the last standby status update and CopyDone (one
	// deadline for both), marking the rows the downstream accepted (both
	// marking statements and the wait between them), closing the
	// replication connection, removing the heartbeat, and the cleanup of a
	// slot whose creation failed. Marking while streaming has the same
	// bound. Zero means 5s. See [Config.StopBound].
	DBTimeout time.Duration

	// DrainTimeout is how long Close (or the end of Run's context) waits for
	// a publish in progress. A publish still running then is left behind:
	// its row is not marked and its transaction not confirmed, so the next
	// Run publishes the message again (the downstream may then have it
	// twice; consumers deduplicate by message id). A later Run of the same
	// Relay waits for it before it streams. Zero means 10s.
	DrainTimeout time.Duration

	// MaxPublishAttempts bounds the attempts for one message. When they are
	// spent Run returns CDC_PUBLISH_FAILED without confirming the message's
	// transaction, so the next Run delivers it again. Zero means retry
	// forever (the relay stalls, visibly, rather than skip a message).
	MaxPublishAttempts int

	// SkipUndecodable makes the relay log and skip an inserted row that
	// cannot become a message (e.g. headers that use a reserved name) instead
	// of stopping with OUTBOX_CORRUPT_ROW. Zero (false) stops: such a row can
	// only come from SQL that bypassed the publisher, and skipping it loses
	// the message for good, since the WAL cannot be edited.
	SkipUndecodable bool

	// Envelope tunes the row-to-message conversion (producer fallback, trace
	// propagator), as for the polling forwarder.
	Envelope envelope.Options
}

func (c Config) withDefaults() Config {
	c.Schema = cmp.Or(c.Schema, DefaultSchema)
	c.SlotName = cmp.Or(c.SlotName, DefaultSlotName)
	c.PublicationName = cmp.Or(c.PublicationName, DefaultPublicationName)
	c.StandbyTimeout = cmp.Or(c.StandbyTimeout, DefaultStandbyTimeout)
	c.SlotBusyWait = cmp.Or(c.SlotBusyWait, DefaultSlotBusyWait)
	c.DBTimeout = cmp.Or(c.DBTimeout, DefaultDBTimeout)
	c.DrainTimeout = cmp.Or(c.DrainTimeout, DefaultDrainTimeout)
	c.RetryInitial = cmp.Or(c.RetryInitial, DefaultRetryInitial)
	c.RetryMax = cmp.Or(c.RetryMax, max(DefaultRetryMax, c.RetryInitial))
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.HeartbeatTTL = cmp.Or(c.HeartbeatTTL, max(DefaultHeartbeatTTL, twice(c.HeartbeatInterval)))
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.LagWarnBytes = cmp.Or(c.LagWarnBytes, DefaultLagWarnBytes)
	c.LagWarnEvery = cmp.Or(c.LagWarnEvery, DefaultLagWarnEvery)
	if c.Owner == "" {
		host, _ := os.Hostname()
		c.Owner = fmt.Sprintf("cdcrelay@%s:%d:%s", cmp.Or(host, "unknown"), os.Getpid(), c.SlotName)
	}
	return c
}

// twice is 2*d, saturated at the int64 bounds instead of wrapping around (a
// wrapped HeartbeatInterval*2 would let a huge interval pass as a small one).
func twice(d time.Duration) time.Duration {
	switch {
	case d > math.MaxInt64/2:
		return math.MaxInt64
	case d < math.MinInt64/2:
		return math.MinInt64
	}
	return 2 * d
}

// Validate reports the first setting that cannot work, as
// OUTBOX_INVALID_CONFIG with what to change.
func (c Config) Validate() error {
	_, err := c.replicationConfig()
	return err
}

// replicationConfig validates c and returns the parsed replication
// connection configuration.
func (c Config) replicationConfig() (*pgconn.Config, error) {
	const op = "cdcrelay.Config"
	invalid := func(format string, args ...any) (*pgconn.Config, error) {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, format, args...)
	}
	if c.ConnString == "" {
		return invalid("ConnString is required (a connection to the outbox's database; replication=database is added)")
	}
	if c.DB == nil {
		return invalid("DB is required (a pool on the same database, used to read the relay mode)")
	}
	c = c.withDefaults()
	for _, f := range []struct{ what, v string }{{"Schema", c.Schema}, {"SlotName", c.SlotName}, {"PublicationName", c.PublicationName}} {
		if !debezium.IsIdentifier(f.v) {
			return invalid("%s %q must match ^[a-z_][a-z0-9_]{0,62}$ (PostgreSQL slot-name rules)", f.what, f.v)
		}
	}
	if c.StandbyTimeout < 0 || c.RetryInitial < 0 || c.RetryMax < 0 || c.SlotBusyWait < 0 || c.HeartbeatInterval < 0 || c.HeartbeatTTL < 0 || c.BatchSize < 0 || c.LagWarnEvery < 0 || c.DBTimeout < 0 || c.DrainTimeout < 0 {
		return invalid("StandbyTimeout, SlotBusyWait, RetryInitial, RetryMax, HeartbeatInterval, HeartbeatTTL, BatchSize, LagWarnEvery, DBTimeout and DrainTimeout must not be negative")
	}
	// StopBound must be a duration: DrainTimeout + 4 x DBTimeout must not
	// overflow (checked without computing it).
	if c.DBTimeout > MaxStopTimeout || c.DrainTimeout > MaxStopTimeout {
		return invalid("DBTimeout (%s) and DrainTimeout (%s) must be at most %s: a stop waits for them (StopBound)", c.DBTimeout, c.DrainTimeout, MaxStopTimeout)
	}
	// Not TTL < 2*Interval: that product overflows for a huge interval.
	if c.HeartbeatInterval > c.HeartbeatTTL/2 {
		return invalid("HeartbeatTTL (%s) must be at least twice HeartbeatInterval (%s): one late heartbeat must not stop the relay", c.HeartbeatTTL, c.HeartbeatInterval)
	}
	if strings.TrimSpace(c.Owner) == "" {
		return invalid("Owner must not be blank")
	}
	if why := pgtext.Unstorable(c.Owner); why != "" {
		return invalid("Owner %q %s (it is written to messaging_relay_heartbeat)", c.Owner, why)
	}
	if i := pgtext.ControlAt(c.Owner); i >= 0 {
		return invalid("Owner %q has a control character at byte %d; use printable text (it is printed in logs and by outboxctl)", c.Owner, i)
	}
	if c.RetryMax < c.RetryInitial {
		return invalid("RetryMax (%s) must be at least RetryInitial (%s)", c.RetryMax, c.RetryInitial)
	}
	if c.MaxPublishAttempts < 0 {
		return invalid("MaxPublishAttempts must not be negative (0 retries forever)")
	}
	pc, err := pgconn.ParseConfig(c.ConnString)
	if err != nil {
		return nil, outbox.Wrap(outbox.CodeInvalidConfig, op, err, "ConnString does not parse")
	}
	switch pc.RuntimeParams["replication"] {
	case "":
		pc.RuntimeParams["replication"] = "database"
	case "database":
	default:
		return invalid("ConnString has replication=%s; logical replication needs replication=database", pc.RuntimeParams["replication"])
	}
	// The walsender formats tuple data with its session settings; pin the
	// ones the decoder depends on, whatever the server's defaults are.
	pc.RuntimeParams["TimeZone"] = "UTC"
	pc.RuntimeParams["DateStyle"] = "ISO, YMD"
	pc.RuntimeParams["bytea_output"] = "hex"
	pc.RuntimeParams["extra_float_digits"] = "3"
	return pc, nil
}
