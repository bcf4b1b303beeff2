package forwarder

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math"
	"os"
	"time"

	"go.opentelemetry.io/otel/trace"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// Defaults. Each satisfies the rules Validate enforces (a test says so).
const (
	DefaultBatchSize = 100
	// DefaultMaxBatchSize is MaxBatchSize when neither it nor BatchSize is set.
	DefaultMaxBatchSize = 1000
	// MaxClaimRows is the most BatchSize, MaxBatchSize and Concurrency may
	// be.
	MaxClaimRows = 10000
	// MaxHeartbeatInterval is the most HeartbeatInterval may be: a relay
	// that stopped without clearing its heartbeat holds off a switch to CDC
	// for 3 intervals.
	MaxHeartbeatInterval     = time.Hour
	DefaultLeaseDuration     = 30 * time.Second
	DefaultPublishTimeout    = 5 * time.Second
	DefaultPollInterval      = 500 * time.Millisecond
	DefaultMaxPollInterval   = 5 * time.Second
	DefaultMaxAttempts       = 25
	DefaultBackoffBase       = time.Second
	DefaultBackoffMax        = 10 * time.Minute
	DefaultConcurrency       = 8
	DefaultHeartbeatInterval = 10 * time.Second
	DefaultBreakerThreshold  = 5
	DefaultBreakerProbeBase  = time.Second
	DefaultBreakerProbeMax   = 30 * time.Second
	// DefaultMaxBatchBytes bounds the payload and header bytes one claim
	// takes: 8 MiB reads in well under a second on a 100 Mbit/s link, a
	// small part of the default lease.
	DefaultMaxBatchBytes = 8 << 20
	// DefaultDBTimeout bounds each of the forwarder's own statements; it is
	// at most half the lease (Validate refuses more).
	DefaultDBTimeout = 15 * time.Second
)

// Config tunes a Forwarder. The zero value of every field means "use the
// default"; negative numbers are refused by Validate.
type Config struct {
	// BatchSize is how many rows a pass claims while the relay keeps up
	// (and at its start). Default 100.
	BatchSize int
	// MaxBatchSize is how many rows a pass may claim while the relay is
	// behind. A claim that comes back full lets the next one take twice as
	// many, up to MaxBatchSize, as long as the larger batch would be
	// published within a quarter of its lease (Concurrency at a time) at
	// the mean time a publish took lately; a claim that comes back less
	// than half full, or a pace that no longer fits, halves it again, down
	// to BatchSize. One key's chain, published one message at a time, is at
	// most as many rows as the slowest destination lately publishes in
	// that time (at least BatchSize, at most MaxBatchSize). With a lease close to 2 x PublishTimeout the bound is
	// the start-by deadline (LeaseDuration - 1.5 x PublishTimeout) for
	// twice the batch (a batch claimed ahead waits for the one before it)
	// rather than the quarter of the lease. Larger
	// claims cost less per row on both sides (one statement, one commit,
	// one walk of the keys for many rows), which is what lets a relay catch
	// up with a backlog instead of trailing it. Default: 1000 when BatchSize
	// is not set either; otherwise BatchSize, so a BatchSize you set stays
	// fixed unless you also set MaxBatchSize. Must be at least BatchSize
	// and at most MaxClaimRows.
	MaxBatchSize int
	// LeaseDuration is how long a claimed row belongs to this relay. It must
	// be at least 2 x PublishTimeout, so that a relay waiting for a confirm
	// cannot see another relay publish the same row meanwhile. Default 30s.
	LeaseDuration time.Duration
	// PublishTimeout bounds one downstream Publish, enforced even when the
	// publisher ignores its context; a publish that runs out is AMBIGUOUS.
	// Default 5s.
	PublishTimeout time.Duration
	// PollInterval is the wait after a pass that found work but not a full
	// batch, and the start of the idle backoff. Default 500ms.
	PollInterval time.Duration
	// MaxPollInterval caps the idle backoff (passes that find nothing).
	// Default 5s, or PollInterval when that is longer; LISTEN/NOTIFY wakes
	// the relay earlier. A lane relay whose lanes are changing hands (it
	// owns fewer than its fair share, or lanes over it still to give back)
	// does not back off: it polls from PollInterval/10, doubling up to
	// PollInterval or 250ms, whichever is longer.
	MaxPollInterval time.Duration
	// MaxAttempts is the attempt budget per row; a row whose attempt budget
	// is spent is parked EXHAUSTED. Default 25. Only attempts whose outcome
	// concerns the message spend it (ambiguous, timed out); a downstream that
	// is unavailable as a whole spends none (see BreakerThreshold).
	MaxAttempts int
	// BackoffBase and BackoffMax shape the exponential retry delay of
	// AMBIGUOUS rows (and of the loop after a failing pass). Defaults 1s,
	// and 10m or BackoffBase when that is longer: with MaxAttempts 25, a message that keeps failing on its own is
	// parked EXHAUSTED between 1 h 18 min and 2 h 37 min after its first
	// attempt (the delays are jittered between half and all of
	// BackoffBase x 2^(n-1), capped at BackoffMax).
	BackoffBase time.Duration
	BackoffMax  time.Duration
	// BreakerThreshold is how many different messages to one destination
	// may fail without an answer about them (unavailable, ambiguous, timed
	// out), with no confirmed publish in between, before the destination's
	// breaker opens (one message failing again counts once; under
	// DefaultClassifier a pass whose every publish to the destination
	// failed alike, on two messages or more, opens it too): the relay
	// then claims nothing for it, puts back what it holds for it without
	// spending attempts, and probes it with one row
	// every BreakerProbeBase, doubling up to BreakerProbeMax (jittered per
	// owner). A confirmed publish closes it. Defaults 5, 1s, and 30s or
	// BreakerProbeBase when that is longer.
	BreakerThreshold int
	BreakerProbeBase time.Duration
	BreakerProbeMax  time.Duration
	// Concurrency is how many units a pass publishes at once: an unkeyed
	// row, or one ordering key's chain (its rows of the batch in seq order,
	// published one at a time, each waiting for the previous outcome), so it
	// never reorders a key. Default 8; at most MaxClaimRows (more workers
	// than a claim can hold rows would have nothing to publish).
	Concurrency int
	// MaxBatchBytes bounds what one claim takes by size: the claim
	// statement stops adding rows (in seq order) once their payloads and
	// headers, as stored, would exceed it; a single row larger than the
	// budget is still claimed, alone; the statements that complete a
	// batch take no row larger than what is left of the budget (a breaker
	// probe's one row excepted: it is taken whatever its size). Rows are
	// still at most the claim's size (BatchSize, up to MaxBatchSize), plus
	// one row per breaker probe due. With prefetch a relay holds up to
	// three batches (one being published, the next claimed ahead, the one
	// before still having its outcomes written). After a claim that
	// failed (for example one that could not be read within DBTimeout over
	// a slow link) the next claim gets half the budget, down to a single
	// row, and each successful claim doubles it back. Default 8 MiB.
	MaxBatchBytes int64
	// DBTimeout bounds each of the forwarder's own statements (a claim, an
	// outcome write). A claim that cannot be read within it is given up and
	// the rows it may hold are released without spending attempts. It must
	// not exceed half of LeaseDuration, so a claim that used all of it
	// leaves the rows time to be published. Default 15s, or half of
	// LeaseDuration when that is shorter.
	DBTimeout time.Duration
	// MaxAbandoned bounds the publishes left running after their timeout
	// (a downstream that ignores its context): while more than this many
	// still run, the relay claims nothing, reports it
	// (Report.AbandonedPublishes, Report.ClaimPaused) and counts it in its
	// metrics, so a downstream that hangs on everything costs at most this
	// many goroutines. Default 2 x Concurrency.
	MaxAbandoned int
	// OrderingPolicy: what a parked row does to later rows of its key.
	// Default fencing.BlockKey.
	OrderingPolicy fencing.OrderingPolicy
	// Owner identifies this relay in leases and heartbeats. It must be
	// unique across replicas. Default: hostname-pid-random, fixed for the
	// life of the Forwarder.
	Owner string
	// Producer is restored as msg.producer on rows that carry none.
	Producer string
	// Classifier turns a publish error into an outcome. Default
	// DefaultClassifier: errors wrapped with Reject are rejections, errors
	// wrapped with MarkUnavailable are unavailable, every other error is
	// ambiguous; and a pass in which every publish to a destination failed
	// with the same error, on two messages or more, is taken as evidence
	// that the destination is unavailable (those rows spend no attempt and
	// its breaker opens), unless every one of them was excused that way
	// before, with the same error, and this relay has published another
	// message to the destination since (then they spend attempts: poison
	// messages failing alike, not an outage). Timeouts and panics stay ambiguous.
	Classifier Classifier
	// ListenURL is a PostgreSQL DSN for LISTEN on NotifyChannel. Empty:
	// polling only. Notifications only shorten the wait; polling continues,
	// so a lost notification delays a message by at most MaxPollInterval.
	// It is checked by Validate: a DSN lib/pq's listener cannot use (one
	// lib/pq cannot parse, such as sslmode=bogus, or with pgx or pgxpool
	// parameters such as pool_max_conns) is refused with
	// OUTBOX_INVALID_CONFIG instead of failing on every reconnect.
	ListenURL string
	// Listener, when set, is used for wake-ups instead of lib/pq's listener
	// on ListenURL (which must then be empty), e.g. one on a pgx connection.
	Listener Listener
	// NotifyChannel is the channel to LISTEN on; it must match the
	// publisher's (publisher.Config.NotifyChannel). Default
	// publisher.DefaultNotifyChannel.
	NotifyChannel string
	// Now is the clock for leases, retry schedules and row timestamps. Nil:
	// the database's clock for rows and time.Now for local deadlines. Tests
	// inject a clock instead of sleeping.
	Now func() time.Time
	// Metrics, when set, receives the forwarder's measurements. For
	// Prometheus: prommetrics.New(registerer, prommetrics.Options{...}),
	// which bounds the destination label (MaxDestinations, "_other").
	Metrics Metrics
	// TracerProvider for publish spans. Nil: the otel global provider.
	TracerProvider trace.TracerProvider
	// HeartbeatInterval is how often the relay renews its relay-mode
	// heartbeat (which lives 3 intervals). Default 10s; at most
	// MaxHeartbeatInterval (1h).
	HeartbeatInterval time.Duration
	// DrainTimeout bounds how long Close (or cancelling Run) waits for the
	// publishes in progress before it records them as ambiguous. It must not
	// exceed LeaseDuration - PublishTimeout, so outcomes are written while
	// the leases still hold. Default PublishTimeout.
	DrainTimeout time.Duration
	// OnReport, when set, is called after every pass (also failing ones),
	// once its outcomes are written: in pass order, never two calls at once,
	// but not always from the same goroutine.
	OnReport func(Report)
	// DisablePrefetch turns off claiming the next batch while a full batch
	// is being published, and publishing it while the previous batch's
	// outcomes are written (Run only; RunOnce does neither). Prefetching
	// holds up to 3 x MaxBatchSize rows per relay, and the claim ahead and the
	// outcome statement each hold a pool connection while they run; per-key
	// order, leases, what a crash leaves and Close's release are the same
	// either way.
	DisablePrefetch bool
	// ShareConnection runs the claims and the outcome writes on one pinned
	// connection, taking turns, instead of one each, while the relay drains
	// full batches (docs/CONFIGURATION.md, "The relay's connections"). The
	// relay still claims the next batch while it publishes one. Measured in
	// paired runs on a 2-core host (BENCHMARKS.md, session 10): the
	// database server's CPU per relayed message lower in 26 of 27 pairs
	// (median 18 %); one relay drained slower in most pairs (by 5 to 23 %),
	// its statements then on one core of the server; four relays on 100
	// ordering keys 9 to 21 % faster, unkeyed or mixed no consistently
	// different. For a database whose CPU the relays should spare, or a
	// fleet of relays on a small server. A statement waits for the other at
	// most 250 ms and a quarter of the time left before its own deadline
	// (DBTimeout), then runs on a connection of the pool. Default false.
	ShareConnection bool
	// Fence is the fence scheme: FenceRows (the default in this release)
	// or FenceLanes.
	//
	// With lanes the relay owns a fair share of the table's lanes (a row's
	// lane comes from its ordering key, or its message id), reads its
	// lanes' rows without writing them and writes each row once, its
	// outcome, fenced by the lane's owner and epoch: one row version per
	// relayed message, and relays that never step over each other's rows
	// (docs/FENCE.md). FenceRows is the per-row lease (the claim writes
	// IN_FLIGHT, the outcome a second version). Lanes become the default
	// once the whole relay suite runs on them (docs/FENCE.md says what is
	// still missing); FenceRows then stays as the way back for a fleet
	// that must roll back. A database runs one scheme at a time: Run
	// refuses with FENCE_SCHEME_CONFLICT while a live relay of the other
	// runs.
	Fence Fence
	// DisablePreparedStatements runs the claim and the outcome writes as
	// plain statements, parsed and planned on every call. Prepared (the
	// default) saves the claim's planning on every pass (it costs more than
	// claiming 100 rows) and a round trip per statement; turn it off behind
	// a pooler in transaction mode that cannot carry prepared statements
	// (PgBouncer before 1.21). See fencing.Prepared.
	DisablePreparedStatements bool

	defaultClassifier bool // Classifier was left to the default: the pass-wide evidence rule applies
}

// Fence is a fence scheme (Config.Fence).
type Fence int

const (
	// FenceRows: a per-row lease written by every claim (the default).
	FenceRows Fence = iota
	// FenceLanes: relays own lanes, not rows.
	FenceLanes
)

func (f Fence) String() string {
	switch f {
	case FenceLanes:
		return fencing.FenceLanes
	case FenceRows:
		return fencing.FenceRows
	}
	return fmt.Sprintf("Fence(%d)", int(f))
}

// withDefaults fills every unset field. The one place defaults live.
func (c Config) withDefaults() Config {
	if c.MaxBatchSize == 0 {
		c.MaxBatchSize = cmp.Or(c.BatchSize, DefaultMaxBatchSize)
	}
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.LeaseDuration = cmp.Or(c.LeaseDuration, DefaultLeaseDuration)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, DefaultPublishTimeout)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.MaxPollInterval = cmp.Or(c.MaxPollInterval, max(DefaultMaxPollInterval, c.PollInterval))
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.BackoffBase = cmp.Or(c.BackoffBase, DefaultBackoffBase)
	c.BackoffMax = cmp.Or(c.BackoffMax, max(DefaultBackoffMax, c.BackoffBase))
	c.Concurrency = cmp.Or(c.Concurrency, DefaultConcurrency)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.BreakerThreshold = cmp.Or(c.BreakerThreshold, DefaultBreakerThreshold)
	c.BreakerProbeBase = cmp.Or(c.BreakerProbeBase, DefaultBreakerProbeBase)
	c.BreakerProbeMax = cmp.Or(c.BreakerProbeMax, max(DefaultBreakerProbeMax, c.BreakerProbeBase))
	c.DrainTimeout = cmp.Or(c.DrainTimeout, c.PublishTimeout)
	c.MaxBatchBytes = cmp.Or(c.MaxBatchBytes, DefaultMaxBatchBytes)
	c.DBTimeout = cmp.Or(c.DBTimeout, min(DefaultDBTimeout, c.LeaseDuration/2))
	// Concurrency is capped before doubling so that a huge one cannot
	// overflow into a negative default (Validate refuses it by name).
	c.MaxAbandoned = cmp.Or(c.MaxAbandoned, 2*min(c.Concurrency, MaxClaimRows))
	c.Owner = cmp.Or(c.Owner, defaultOwner())
	c.NotifyChannel = cmp.Or(c.NotifyChannel, publisher.DefaultNotifyChannel)
	if c.Classifier == nil {
		c.Classifier = DefaultClassifier
		c.defaultClassifier = true
	}
	return c
}

// Validate reports the first rule the configuration (with defaults filled
// in) breaks, as OUTBOX_LEASE_TOO_SHORT or OUTBOX_INVALID_CONFIG with a
// message that says what to change.
func (c Config) Validate() error {
	_, err := c.validated()
	return err
}

func (c Config) validated() (Config, error) {
	const op = "forwarder.Config"
	c = c.withDefaults()
	bad := func(format string, args ...any) (Config, error) {
		return Config{}, outbox.Errorf(outbox.CodeInvalidConfig, op, format, args...)
	}
	if c.Fence != FenceLanes && c.Fence != FenceRows {
		return bad("unknown fence scheme %d (FenceLanes or FenceRows)", int(c.Fence))
	}
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"BatchSize", int64(c.BatchSize)}, {"MaxBatchSize", int64(c.MaxBatchSize)}, {"MaxAttempts", int64(c.MaxAttempts)}, {"Concurrency", int64(c.Concurrency)},
		{"LeaseDuration", int64(c.LeaseDuration)}, {"PublishTimeout", int64(c.PublishTimeout)},
		{"PollInterval", int64(c.PollInterval)}, {"MaxPollInterval", int64(c.MaxPollInterval)},
		{"BackoffBase", int64(c.BackoffBase)}, {"BackoffMax", int64(c.BackoffMax)},
		{"HeartbeatInterval", int64(c.HeartbeatInterval)}, {"DrainTimeout", int64(c.DrainTimeout)},
		{"BreakerThreshold", int64(c.BreakerThreshold)}, {"BreakerProbeBase", int64(c.BreakerProbeBase)},
		{"BreakerProbeMax", int64(c.BreakerProbeMax)}, {"MaxBatchBytes", c.MaxBatchBytes},
		{"DBTimeout", int64(c.DBTimeout)}, {"MaxAbandoned", int64(c.MaxAbandoned)},
	} {
		if f.v < 0 {
			return bad("%s must be positive (or zero for the default), got %d", f.name, f.v)
		}
	}
	if c.MaxAttempts > math.MaxInt32 {
		return bad("MaxAttempts %d is beyond what the attempts column (integer) can count; use at most %d", c.MaxAttempts, math.MaxInt32)
	}
	if c.MaxBatchSize > MaxClaimRows {
		return bad("BatchSize %d / MaxBatchSize %d exceed %d rows: a claim holds its rows in memory (about 1 KB each before payloads) and in one statement's arrays; use at most %d",
			c.BatchSize, c.MaxBatchSize, MaxClaimRows, MaxClaimRows)
	}
	if c.MaxBatchSize < c.BatchSize {
		return bad("MaxBatchSize %d is below BatchSize %d; raise MaxBatchSize (or leave it zero: BatchSize, fixed)", c.MaxBatchSize, c.BatchSize)
	}
	if c.Concurrency > MaxClaimRows {
		return bad("Concurrency %d exceeds %d: a pass publishes at most the rows of one claim (MaxClaimRows), so more workers would have nothing to do; use at most %d",
			c.Concurrency, MaxClaimRows, MaxClaimRows)
	}
	if c.HeartbeatInterval > MaxHeartbeatInterval {
		return bad("HeartbeatInterval %s exceeds %s: the heartbeat lives 3 intervals, and a relay that stopped holds off a switch to CDC that long; use at most %s",
			c.HeartbeatInterval, MaxHeartbeatInterval, MaxHeartbeatInterval)
	}
	// LeaseDuration < 2 x PublishTimeout, written so that it cannot overflow
	// (for non-negative a, b: a < 2b exactly when b > a/2, rounding down).
	if c.PublishTimeout > c.LeaseDuration/2 {
		need := "2 x PublishTimeout"
		if c.PublishTimeout <= math.MaxInt64/2 {
			need = (2 * c.PublishTimeout).String()
		}
		return Config{}, outbox.Errorf(outbox.CodeLeaseTooShort, op,
			"LeaseDuration %s is shorter than 2 x PublishTimeout (%s): another relay could publish a row while this one still waits for a confirm; raise LeaseDuration to at least %s or lower PublishTimeout",
			c.LeaseDuration, c.PublishTimeout, need)
	}
	if c.DBTimeout > c.LeaseDuration/2 {
		return bad("DBTimeout %s exceeds half of LeaseDuration (%s): a claim that took that long would leave its rows too little of their lease to be published; lower DBTimeout or raise LeaseDuration",
			c.DBTimeout, c.LeaseDuration/2)
	}
	if c.BackoffMax < c.BackoffBase {
		return bad("BackoffMax %s is below BackoffBase %s; raise BackoffMax or lower BackoffBase", c.BackoffMax, c.BackoffBase)
	}
	if c.BreakerProbeMax < c.BreakerProbeBase {
		return bad("BreakerProbeMax %s is below BreakerProbeBase %s; raise BreakerProbeMax", c.BreakerProbeMax, c.BreakerProbeBase)
	}
	if c.MaxPollInterval < c.PollInterval {
		return bad("MaxPollInterval %s is below PollInterval %s; raise MaxPollInterval", c.MaxPollInterval, c.PollInterval)
	}
	if c.DrainTimeout > c.LeaseDuration-c.PublishTimeout {
		return bad("DrainTimeout %s exceeds LeaseDuration - PublishTimeout (%s): outcomes would be written after the leases expire; lower DrainTimeout or raise LeaseDuration",
			c.DrainTimeout, c.LeaseDuration-c.PublishTimeout)
	}
	if !c.OrderingPolicy.Valid() {
		return bad("OrderingPolicy %d is unknown; use fencing.BlockKey or fencing.SkipParked", int(c.OrderingPolicy))
	}
	if len(c.NotifyChannel) > 63 || pgtext.Unstorable(c.NotifyChannel) != "" {
		return bad("NotifyChannel must be at most 63 bytes of UTF-8 (a PostgreSQL identifier) without NUL characters")
	}
	if c.Listener != nil && c.ListenURL != "" {
		return bad("set either ListenURL (lib/pq's listener) or Listener, not both")
	}
	if c.ListenURL != "" {
		if why := checkListenURL(c.ListenURL); why != "" {
			return bad("%s", why)
		}
	}
	if len(c.Owner) > 200 {
		return bad("Owner must be at most 200 bytes, got %d", len(c.Owner))
	}
	for _, f := range [...]struct{ name, v string }{{"Owner", c.Owner}, {"Producer", c.Producer}} {
		if pgtext.Unstorable(f.v) != "" || pgtext.ControlAt(f.v) >= 0 {
			return bad("%s must be printable UTF-8 text (it is written to rows and printed in logs and by outboxctl), got %q", f.name, f.v)
		}
	}
	return c, nil
}

func defaultOwner() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "relay"
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b))
}
