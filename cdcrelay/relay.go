package cdcrelay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq/pqerror"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/internal/redact"
	"github.com/fencedoutbox/watermill-outbox/internal/startstop"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Codes of the refusals Run returns. The relay-mode refusal is the debezium
// package's RELAY_MODE_CONFLICT (relaymode.ErrRelayModeConflict), a second CDC
// consumer on another slot is debezium's CDC_SECOND_CONSUMER; invalid
// settings are OUTBOX_INVALID_CONFIG and a row that cannot become a message
// is OUTBOX_CORRUPT_ROW.
const (
	// CodePublishFailed: a message was refused MaxPublishAttempts times. Its
	// transaction was not confirmed; the next Run delivers it again.
	CodePublishFailed outbox.Code = "CDC_PUBLISH_FAILED"
	// CodeSlotMissing: the replication slot does not exist and CreateSlot is off.
	CodeSlotMissing outbox.Code = "CDC_SLOT_MISSING"
	// CodeSlotInUse: another consumer is streaming from the slot (one relay
	// per slot), or the slot is not a pgoutput slot of this database.
	CodeSlotInUse outbox.Code = "CDC_SLOT_IN_USE"
	// CodePublicationMissing: the publication does not exist (and
	// CreatePublication is off) or does not publish messaging_outbox inserts.
	CodePublicationMissing outbox.Code = "CDC_PUBLICATION_MISSING"
	// CodeRelayClosed: Run after Close.
	CodeRelayClosed outbox.Code = "CDC_RELAY_CLOSED"
	// CodeAlreadyRunning: Run while another Run of the same Relay is active.
	CodeAlreadyRunning outbox.Code = "CDC_RELAY_ALREADY_RUNNING"
	// CodeSlotLost: the slot was invalidated (wal_status "lost"), e.g. because
	// it fell behind by more than max_slot_wal_keep_size. The detail carries
	// PostgreSQL's message and DETAIL. The WAL it needed is gone: rows in it
	// were never streamed. See "A lost slot" in docs/CDC.md.
	CodeSlotLost outbox.Code = "CDC_SLOT_LOST"
	// CodeUndeliveredRows: rows committed before the slot was created are
	// still undelivered; they are not in the slot, so streaming would skip
	// them. Refused when Run would create the slot in CDC mode, and on every
	// start while rows older than the slot (messaging_cdc_slot.before_seq)
	// are undelivered.
	CodeUndeliveredRows outbox.Code = "CDC_UNDELIVERED_ROWS"
	// CodeHeartbeatLapsed: no CDC heartbeat succeeded for HeartbeatTTL; the
	// relay stopped before publishing more, since the mode may have left
	// CDC meanwhile.
	CodeHeartbeatLapsed outbox.Code = "CDC_HEARTBEAT_LAPSED"
)

// Sentinels for errors.Is.
var (
	ErrPublishFailed      = &outbox.Error{Code: CodePublishFailed}
	ErrSlotMissing        = &outbox.Error{Code: CodeSlotMissing}
	ErrSlotInUse          = &outbox.Error{Code: CodeSlotInUse}
	ErrPublicationMissing = &outbox.Error{Code: CodePublicationMissing}
	ErrRelayClosed        = &outbox.Error{Code: CodeRelayClosed}
	ErrAlreadyRunning     = &outbox.Error{Code: CodeAlreadyRunning}
	ErrSlotLost           = &outbox.Error{Code: CodeSlotLost}
	ErrUndeliveredRows    = &outbox.Error{Code: CodeUndeliveredRows}
	ErrHeartbeatLapsed    = &outbox.Error{Code: CodeHeartbeatLapsed}
)

// Table is the only relation the relay streams.
const Table = debezium.Table

// Relay streams committed inserts of messaging_outbox from a logical
// replication slot and publishes each as a watermill message. See the package
// documentation for its guarantees.
type Relay struct {
	cfg    Config
	pc     *pgconn.Config
	out    message.Publisher
	logger watermill.LoggerAdapter

	// runs is Run's start and stop: one Run (or handover) at a time, Run
	// again after it returned, Close idempotent, also before Run, and
	// waiting for the active Run.
	runs startstop.Runs

	// Owned by the goroutine in Run.
	lastBeat time.Time // when the last successful heartbeat was sent
	lastWarn time.Time
	failing  failure // the message the downstream keeps refusing, across sessions
	// behind gets the result of a publish a stop left running (DrainTimeout):
	// the next Run waits for it, so a Relay never has two publishes at once.
	behind <-chan published
}

// failure counts the attempts of the message being retried: a refused
// publish ends the replication session (see deliver), so the count and the
// backoff live on the relay, not the session.
type failure struct {
	id       string
	attempts int
	delay    time.Duration
}

// New validates cfg (OUTBOX_INVALID_CONFIG) and returns a relay publishing to
// out. A nil logger logs nothing. New does not connect.
func New(cfg Config, out message.Publisher, logger watermill.LoggerAdapter) (*Relay, error) {
	pc, err := cfg.replicationConfig()
	if err != nil {
		return nil, err
	}
	if out == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "cdcrelay.New", "a publisher is required")
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Relay{cfg: cfg.withDefaults(), pc: pc, out: out, logger: logger}, nil
}

// Close stops Run (the message being published is finished within
// DrainTimeout or left behind; what was published is marked PUBLISHED, and a
// transaction is confirmed only if every message of it was published) and
// waits for it to return: at most [Config.StopBound]. Safe to call twice, or
// before Run.
func (r *Relay) Close() error {
	r.runs.Close()
	return nil
}

// Run checks the relay mode, registers the relay's CDC heartbeat, checks the
// publication and the slot, then streams until ctx ends or Close is called
// (it returns nil), the relay mode leaves CDC (RELAY_MODE_CONFLICT), another
// CDC consumer is live on another slot (CDC_SECOND_CONSUMER), the slot is
// lost (CDC_SLOT_LOST), rows older than the slot are undelivered
// (CDC_UNDELIVERED_ROWS), a message cannot be delivered
// (CDC_PUBLISH_FAILED, OUTBOX_CORRUPT_ROW), the heartbeat lapses
// (CDC_HEARTBEAT_LAPSED) or a connection fails. Whatever it returns, the
// rows it published are marked PUBLISHED (unless the database does not
// answer within DBTimeout; a publish a stop left behind after DrainTimeout
// is not marked), the slot has confirmed only transactions whose every
// message the publisher accepted, and its heartbeat is removed (within
// DBTimeout). A stop takes at most [Config.StopBound].
func (r *Relay) Run(ctx context.Context) error {
	ctx, finish, err := r.runs.Start(ctx)
	switch {
	case errors.Is(err, startstop.ErrClosed):
		return outbox.Errorf(CodeRelayClosed, "cdcrelay.Run", "the relay is closed; create a new one")
	case err != nil:
		return outbox.Errorf(CodeAlreadyRunning, "cdcrelay.Run", "Run is already active on this relay")
	}
	defer finish()

	if !r.waitBehind(ctx) {
		return nil
	}
	err = r.run(ctx)
	if ctx.Err() != nil && !isRefusal(err) {
		return nil // closed or cancelled: a clean stop
	}
	return err
}

// waitBehind waits for a publish the last stop left running (DrainTimeout):
// nothing is published before it has returned. False when ctx ended first.
func (r *Relay) waitBehind(ctx context.Context) bool {
	if r.behind == nil {
		return true
	}
	select {
	case <-r.behind:
		r.behind = nil
		return true
	case <-ctx.Done():
		return false
	}
}

func isRefusal(err error) bool { return outbox.CodeOf(err) != "" }

// errRetry ends a replication session after the downstream refused a
// message: the relay drops the connection, backs off without holding a
// walsender, and streams again from the slot's confirmed position.
var errRetry = errors.New("cdcrelay: publish refused; reconnecting after backoff")

func (r *Relay) run(ctx context.Context) error {
	if err := r.checkMode(ctx); err != nil {
		return err
	}
	if err := r.checkSchema(ctx); err != nil {
		return err
	}
	if err := r.beat(ctx); err != nil {
		return err
	}
	defer r.leave(ctx)
	if err := r.ensurePublication(ctx, r.cfg.CreatePublication); err != nil {
		return err
	}
	for {
		start, err := r.ensureSlot(ctx, r.cfg.CreateSlot, false)
		if err != nil {
			return err
		}
		if err := r.checkBoundary(ctx); err != nil {
			return err
		}
		err = r.session(ctx, start, r.cfg.DB, 0)
		if !errors.Is(err, errRetry) {
			return err
		}
		// No replication connection is open while the relay waits: the
		// server can shut down or fail over.
		t := time.NewTimer(r.failing.delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		r.failing.delay = nextDelay(r.failing.delay, r.cfg.RetryMax)
		if err := r.ensureBeat(ctx); err != nil {
			return err
		}
	}
}

// nextDelay doubles the backoff d up to limit; d*2 is never computed when
// it would pass limit, so it cannot wrap around to a negative delay.
func nextDelay(d, limit time.Duration) time.Duration {
	if d > limit/2 {
		return limit
	}
	return 2 * d
}

// checkMode refuses unless the database records CDC mode: while it says
// POLLING, forwarders may be running and would publish the same rows.
func (r *Relay) checkMode(ctx context.Context) error {
	return relaymode.RequireMode(ctx, r.cfg.DB, relaymode.ModeCDC, "cdcrelay.Run",
		"stop the polling relays and run `outboxctl debezium enable` first")
}

// beat renews the relay's CDC heartbeat (which re-reads the mode under the
// mode row's lock). Until lastBeat+HeartbeatTTL the mode cannot leave CDC.
func (r *Relay) beat(ctx context.Context) error {
	sent := time.Now()
	if err := relaymode.BeatCDC(ctx, r.cfg.DB, r.cfg.Owner, r.cfg.SlotName, r.cfg.HeartbeatTTL); err != nil {
		return err
	}
	r.lastBeat = sent
	r.checkLag(ctx)
	return nil
}

// ensureBeat beats when HeartbeatInterval has passed since the last
// successful beat. A refusal stops the relay; a failure is tolerated while
// the last heartbeat is alive, and stops the relay (CDC_HEARTBEAT_LAPSED)
// after that: it no longer knows that the mode is CDC. A renewal that
// blocks (a lock held on the heartbeat row, a server that stopped
// answering) is a failure too: it may take what is left of the heartbeat's
// life, HeartbeatInterval at least, and no more.
func (r *Relay) ensureBeat(ctx context.Context) error {
	since := time.Since(r.lastBeat)
	if since < r.cfg.HeartbeatInterval {
		return nil
	}
	bctx, cancel := context.WithTimeout(ctx, max(r.cfg.HeartbeatTTL-since, r.cfg.HeartbeatInterval))
	err := r.beat(bctx)
	cancel()
	if err == nil || isRefusal(err) || ctx.Err() != nil {
		return err
	}
	if since = time.Since(r.lastBeat); since >= r.cfg.HeartbeatTTL {
		return outbox.Wrap(CodeHeartbeatLapsed, "cdcrelay.Run", err, fmt.Sprintf("no CDC heartbeat succeeded for %s (HeartbeatTTL %s); the relay mode may have changed meanwhile, so nothing more is published", since.Round(time.Millisecond), r.cfg.HeartbeatTTL))
	}
	r.logger.Error("CDC relay heartbeat failed; publishing stops once it has failed for HeartbeatTTL", err, watermill.LogFields{"ttl": r.cfg.HeartbeatTTL})
	return nil
}

// leave removes the heartbeat, within DBTimeout also after ctx has ended.
func (r *Relay) leave(ctx context.Context) {
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.DBTimeout)
	defer cancel()
	if err := relaymode.Leave(lctx, r.cfg.DB, r.cfg.Owner); err != nil {
		r.logger.Error("CDC relay heartbeat not removed; Disable refuses until it expires", err, watermill.LogFields{"ttl": r.cfg.HeartbeatTTL})
	}
}

// session streams from the slot's confirmed position (start) until it ends:
// with stopAt, once every transaction before stopAt is published, marked
// through db and confirmed (it returns errDrained).
func (r *Relay) session(ctx context.Context, start pglogrepl.LSN, db querier, stopAt pglogrepl.LSN) error {
	conn, closeConn, err := r.connectReplication(ctx)
	if err != nil {
		return err
	}
	defer closeConn()
	err = pglogrepl.StartReplication(ctx, conn, r.cfg.SlotName, 0, r.startOptions())
	if err != nil {
		if isSQLState(err, pqerror.ObjectInUse) {
			return outbox.Wrap(CodeSlotInUse, "cdcrelay.Run", err, fmt.Sprintf("slot %s is being streamed by another consumer; one relay per slot", r.cfg.SlotName))
		}
		if isSQLState(err, pqerror.ObjectNotInPrerequisiteState) {
			return r.slotLost(ctx, err)
		}
		return fmt.Errorf("cdcrelay: start replication on slot %s: %w", r.cfg.SlotName, err)
	}
	r.logger.Info("CDC relay streaming", watermill.LogFields{"slot": r.cfg.SlotName, "publication": r.cfg.PublicationName, "confirmed_lsn": start.String()})
	s := &stream{r: r, db: db, stopAt: stopAt, conn: conn, rels: map[uint32]*pglogrepl.RelationMessage{}, confirmed: start}
	err = s.loop(ctx)
	if errors.Is(err, errDrained) {
		s.report() // the next session starts where this one ended
	}
	// Whatever ended the session, what the downstream accepted is marked, so
	// neither a restarted relay nor the forwarders publish it again: within
	// DBTimeout, also after ctx has ended.
	// A mark that already failed during a stop is not tried again: the stop
	// gave marking its DBTimeout (Config.StopBound).
	if ctx.Err() != nil && s.markFailed && len(s.published) > 0 {
		r.logger.Error("CDC relay stopped without marking published rows; they are published again by the next Run", nil, watermill.LogFields{"rows": len(s.published)})
		return err
	}
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.DBTimeout)
	defer cancel()
	if merr := s.markPublished(mctx); merr != nil && err == nil {
		err = merr
	}
	return err
}

// connectReplication opens a replication connection (Config.ConnString);
// closeConn closes it within DBTimeout, also after ctx has ended.
func (r *Relay) connectReplication(ctx context.Context) (conn *pgconn.PgConn, closeConn func(), err error) {
	conn, err = pgconn.ConnectConfig(ctx, r.pc)
	if err != nil {
		return nil, nil, fmt.Errorf("cdcrelay: connect for replication: %w", redact.Error(err, r.cfg.ConnString))
	}
	return conn, func() {
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.DBTimeout)
		defer ccancel()
		_ = conn.Close(cctx)
	}, nil
}

// startOptions are the START_REPLICATION options of a session.
func (r *Relay) startOptions() pglogrepl.StartReplicationOptions {
	return pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication,
		// Protocol 1 without streaming: the server sends a transaction only
		// once it has committed, whole, so an aborted transaction's inserts
		// never reach the relay and each insert may be published as it arrives.
		PluginArgs: []string{"proto_version '1'", "publication_names '" + r.cfg.PublicationName + "'"},
	}
}
