package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wmforwarder "github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// The minimal relay: claim with SKIP LOCKED, publish, one UPDATE for the
// whole batch, all in one transaction. It records per-row state (status,
// published_at) and nothing else: no lease, no token, no attempt count.
const (
	minimalClaim = `SELECT message_id, destination, payload FROM messaging_outbox
 WHERE published_at IS NULL AND parked_at IS NULL AND status = 'PENDING'
 ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED`
	minimalDone = `UPDATE messaging_outbox SET status = 'PUBLISHED', published_at = now()
 WHERE message_id = ANY($1::text[])`
)

// Relay kinds of the drain scenarios.
const (
	relayOurs           = "outbox"                  // this module's forwarder (fencing on), defaults
	relayOursTuned      = "outbox-tuned"            // same, BatchSize ourTunedBatch (watermill tuned reads 1000 per query)
	relayOursNoPF       = "outbox-noprefetch"       // defaults but DisablePrefetch: the pipelining's paired baseline
	relayOursB100       = "outbox-b100"             // BatchSize 100, fixed: the minimal relay's batch, claim for claim
	relayOursTunedNoPF  = "outbox-tuned-noprefetch" // BatchSize ourTunedBatch, DisablePrefetch
	relayOursLanes      = "outbox-lanes"            // defaults with Fence: FenceLanes (one write per message)
	relayOursLanesShare = "outbox-lanes-share"      // lanes with ShareConnection: claims and outcomes on one backend (evidence)
	ourTunedBatch       = 1000
	relayWMDefault      = "watermill"        // components/forwarder + watermill-sql subscriber, defaults
	relayWMTuned        = "watermill-tuned"  // same, PollInterval 10ms, batch 1000
	relayMinimal        = "skiplocked"       // minimal SKIP LOCKED relay, one UPDATE per batch
	relayMinimalTuned   = "skiplocked-tuned" // same, batch minimalTunedBatch
	wmTunedPoll         = 10 * time.Millisecond
	wmTunedBatch        = 1000
	minimalBatchSize    = forwarder.DefaultBatchSize
	minimalTunedBatch   = ourTunedBatch
)

// sink is the downstream: a watermill GoChannel with one subscriber that
// acks and counts.
type sink struct {
	ch     *gochannel.GoChannel
	count  atomic.Int64
	target int64
	done   chan struct{}
	once   sync.Once
	// onMessage, when set, sees every message as it arrives.
	onMessage func(*message.Message, time.Time)
}

func newSink(ctx context.Context, target int) (*sink, error) {
	s := &sink{
		ch:     gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, watermill.NopLogger{}),
		target: int64(target),
		done:   make(chan struct{}),
	}
	msgs, err := s.ch.Subscribe(ctx, benchTopic)
	if err != nil {
		return nil, err
	}
	go func() {
		for m := range msgs {
			if s.onMessage != nil {
				s.onMessage(m, time.Now())
			}
			m.Ack()
			if s.count.Add(1) == s.target {
				s.once.Do(func() { close(s.done) })
			}
		}
	}()
	return s, nil
}

func (s *sink) close() { _ = s.ch.Close() }

// relay is a running relay of any kind; stop drains it and waits (once;
// later calls return at once).
type relay struct {
	stop func()
	// failed receives the error of a relay that ended on its own (not
	// stopped): a cell waiting for its messages returns it at once instead
	// of waiting out its timeout with the cause unseen.
	failed   chan error
	stopping atomic.Bool
}

// ended reports a relay's end to failed when it was not stopped (neither
// stop nor its context had ended it) and returns err for the relay's stop.
func (r *relay) ended(ctx context.Context, err error) error {
	if r.stopping.Load() || ctx.Err() != nil {
		return err
	}
	why := err
	if why == nil {
		why = errors.New("it returned before it was stopped")
	}
	select {
	case r.failed <- why:
	default:
	}
	return err
}

// startRelay starts n relays of kind on the schema, publishing to out.
// listen turns LISTEN/NOTIFY wake-up on for this module's forwarder.
func startRelay(ctx context.Context, s *schema, kind string, n int, out message.Publisher, listen bool) (*relay, error) {
	r := &relay{failed: make(chan error, 1)}
	var stops []func()
	stopAll := func() {
		r.stopping.Store(true)
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	for range n {
		db, err := s.open(3)
		if err != nil {
			stopAll()
			return nil, err
		}
		stops = append(stops, func() { _ = db.Close() })
		rctx, cancel := context.WithCancel(ctx)
		errc := make(chan error, 1)
		switch kind {
		case relayOurs, relayOursTuned, relayOursNoPF, relayOursTunedNoPF, relayOursB100, relayOursLanes, relayOursLanesShare, relayWMDefault, relayWMTuned:
			f, err := newForwarder(kind, s, db, out, listen)
			if err != nil {
				cancel()
				stopAll()
				return nil, err
			}
			go func() { errc <- r.ended(rctx, f.Run(rctx)) }()
			select {
			case <-f.Running():
			case err := <-errc:
				cancel()
				stopAll()
				return nil, fmt.Errorf("%s relay did not start: %w", kind, err)
			}
			stops = append(stops, func() { _ = f.Close(); cancel(); <-errc })
		case relayOneCommit:
			go func() { errc <- r.ended(rctx, runOneCommit(rctx, db, out)) }()
			stops = append(stops, func() { cancel(); <-errc })
		case relayMinimal, relayMinimalTuned:
			batch := minimalBatchSize
			if kind == relayMinimalTuned {
				batch = minimalTunedBatch
			}
			go func() { errc <- r.ended(rctx, runMinimal(rctx, db, out, batch)) }()
			stops = append(stops, func() { cancel(); <-errc })
		default:
			cancel()
			stopAll()
			return nil, fmt.Errorf("unknown relay %q", kind)
		}
	}
	r.stop = sync.OnceFunc(stopAll)
	return r, nil
}

// runner is what this module's forwarder and watermill's share: Run until
// Close, Running closed once started.
type runner interface {
	Run(ctx context.Context) error
	Running() chan struct{}
	Close() error
}

// newForwarder builds the forwarder of kind (ours or watermill's) on db.
// listen turns LISTEN/NOTIFY wake-up on for ours.
func newForwarder(kind string, s *schema, db *sql.DB, out message.Publisher, listen bool) (runner, error) {
	switch kind {
	case relayWMDefault, relayWMTuned:
		cfg := wsql.SubscriberConfig{
			SchemaAdapter:  wsql.DefaultPostgreSQLSchema{},
			OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		}
		if kind == relayWMTuned {
			cfg.SchemaAdapter = wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: wmTunedBatch}
			cfg.PollInterval = wmTunedPoll
		}
		sub, err := wsql.NewSubscriber(db, cfg, nil)
		if err != nil {
			return nil, err
		}
		// The forwarder's router closes the subscriber; closing it a second
		// time races inside watermill-sql (its closed flag is not
		// synchronised), so nobody else does.
		return wmforwarder.NewForwarder(sub, out, watermill.NopLogger{}, wmforwarder.Config{ForwarderTopic: wmForwarderTopic})
	default:
		cfg := forwarder.Config{DisablePrefetch: kind == relayOursNoPF || kind == relayOursTunedNoPF}
		switch kind {
		case relayOursTuned, relayOursTunedNoPF:
			cfg.BatchSize = ourTunedBatch
		case relayOursB100:
			cfg.BatchSize = minimalBatchSize // set alone: fixed, no growth to MaxBatchSize
		case relayOursLanes:
			cfg.Fence = forwarder.FenceLanes
		case relayOursLanesShare:
			cfg.Fence, cfg.ShareConnection = forwarder.FenceLanes, true
		}
		if listen {
			cfg.ListenURL = s.url
		}
		return forwarder.New(db, out, nil, cfg)
	}
}

// runMinimal is the minimal SKIP LOCKED relay. It polls every 10ms when
// idle (it is only measured draining a backlog).
func runMinimal(ctx context.Context, db *sql.DB, out message.Publisher, batch int) error {
	for ctx.Err() == nil {
		n, err := minimalPass(ctx, db, out, batch)
		if err != nil && ctx.Err() == nil {
			return err
		}
		if n == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	return nil
}

func minimalPass(ctx context.Context, db *sql.DB, out message.Publisher, batch int) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	rows, err := tx.QueryContext(ctx, minimalClaim, batch)
	if err != nil {
		return 0, err
	}
	var ids []string
	byTopic := map[string][]*message.Message{}
	for rows.Next() {
		var id, dest string
		var payload []byte
		if err := rows.Scan(&id, &dest, &payload); err != nil {
			_ = rows.Close()
			return 0, err
		}
		ids = append(ids, id)
		byTopic[dest] = append(byTopic[dest], message.NewMessage(id, payload))
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, nil
	}
	for topic, msgs := range byTopic {
		if err := out.Publish(topic, msgs...); err != nil {
			return 0, err
		}
	}
	if _, err := tx.ExecContext(ctx, minimalDone, pq.Array(ids)); err != nil {
		return 0, err
	}
	return len(ids), tx.Commit()
}
