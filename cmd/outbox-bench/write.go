package main

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wmforwarder "github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// benchTopic is the downstream topic of every benchmark message.
const benchTopic = "bench.orders"

// wmForwarderTopic is where watermill's forwarder publisher puts its
// envelopes (components/forwarder's default), so the SQL table is
// "watermill_forwarder_topic".
const wmForwarderTopic = "forwarder_topic"

// rawTable is the floor of a commit: the smallest row that can carry a
// message, a primary key and a payload, no other index. Its INSERT sends
// the payloads as the publisher does (end to end in one bytea, cut apart by
// start and length on the server, the cheapest transport we know for a
// batch), so the two differ only by the table.
const (
	rawTableDDL = `CREATE TABLE bench_raw (id text PRIMARY KEY, payload bytea NOT NULL)`
	rawInsert   = `INSERT INTO bench_raw (id, payload)
SELECT u.id, substring($2::bytea FROM u.at FOR u.len) FROM unnest($1::text[], $3::int4[], $4::int4[]) AS u(id, at, len)`
)

// Write-side implementations.
const (
	implPublisher = "publisher" // this module's publisher, statements prepared (publisher.Prepare: the README's setup)
	implWatermill = "watermill" // watermill-sql v3 publisher wrapped by components/forwarder's publisher
	implRaw       = "raw"       // minimal INSERT
	// implPublisherPlain is the publisher without Config.Prepared (one
	// statement parsed and planned per Publish, two round trips), and
	// implRawPrepared the raw INSERT as a prepared statement: the paired
	// baselines that show what preparing buys each side.
	implPublisherPlain = "publisher-unprepared"
	implRawPrepared    = "raw-prepared"
	// implPublisherNotify is the publisher with the same-statement NOTIFY
	// (the latency scenario's wake-up).
	implPublisherNotify = "publisher-notify"
	// implPublisherKeyed is the publisher (prepared) writing messages with
	// ordering keys (every message one of Config.WriteKeys, at random, all
	// of a transaction in one Publish), and implPublisherLocked the same
	// with publisher.Config.LockOrderingKeys (a transaction-scoped advisory
	// lock per ordering key inside the INSERT, issue 14): the paired cells
	// that give that option's cost.
	implPublisherKeyed  = "publisher-keyed"
	implPublisherLocked = "publisher-keyed-locked"
)

// keyedWriteImpls are the keyed write cells, run after writeImpls.
func keyedWriteImpls() []string { return []string{implPublisherKeyed, implPublisherLocked} }

// initWatermillTables creates watermill-sql's message and offsets tables
// for the forwarder topic in the schema (what AutoInitializeSchema would do,
// which watermill-sql forbids inside a transaction).
func initWatermillTables(ctx context.Context, db *sql.DB) error {
	var qs []wsql.Query
	qs = append(qs, wsql.DefaultPostgreSQLSchema{}.SchemaInitializingQueries(wmForwarderTopic)...)
	qs = append(qs, wsql.DefaultPostgreSQLOffsetsAdapter{}.SchemaInitializingQueries(wmForwarderTopic)...)
	for _, q := range qs {
		if _, err := db.ExecContext(ctx, q.Query, q.Args...); err != nil {
			return fmt.Errorf("watermill-sql schema: %w", err)
		}
	}
	return nil
}

func newMessages(n int, payload []byte) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
	}
	return msgs
}

// writer writes transactions of one implementation into one schema.
type writer struct {
	db   *sql.DB
	impl string
	pub  *publisher.Prepared // implPublisher, implPublisherNotify, the keyed ones
	raw  *sql.Stmt           // implRawPrepared
}

// newWriter prepares what impl needs on db; close releases it.
func newWriter(ctx context.Context, db *sql.DB, impl string) (*writer, error) {
	w := &writer{db: db, impl: impl}
	var err error
	switch impl {
	case implPublisher, implPublisherNotify, implPublisherKeyed, implPublisherLocked:
		w.pub, err = publisher.Prepare(ctx, db)
	case implRawPrepared:
		w.raw, err = db.PrepareContext(ctx, rawInsert)
	}
	return w, err
}

func (w *writer) close() {
	if w.pub != nil {
		_ = w.pub.Close()
	}
	if w.raw != nil {
		_ = w.raw.Close()
	}
}

// writeTx writes msgs in one transaction with the writer's implementation.
func (w *writer) writeTx(ctx context.Context, msgs []*message.Message) error {
	impl := w.impl
	tx, err := w.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	switch impl {
	case implPublisher, implPublisherNotify, implPublisherPlain, implPublisherKeyed, implPublisherLocked:
		cfg := publisher.Config{Notify: impl == implPublisherNotify, Prepared: w.pub, LockOrderingKeys: impl == implPublisherLocked}
		p, err := publisher.New(tx, cfg, nil)
		if err != nil {
			return err
		}
		if err := p.Publish(benchTopic, msgs...); err != nil {
			return err
		}
	case implWatermill:
		sp, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, nil)
		if err != nil {
			return err
		}
		fp := wmforwarder.NewPublisher(sp, wmforwarder.PublisherConfig{ForwarderTopic: wmForwarderTopic})
		if err := fp.Publish(benchTopic, msgs...); err != nil {
			return err
		}
	case implRaw, implRawPrepared:
		ids := make([]string, len(msgs))
		var payloads []byte
		at, lens := make(pq.Int32Array, len(msgs)), make(pq.Int32Array, len(msgs))
		for i, m := range msgs {
			ids[i], at[i], lens[i] = m.UUID, int32(len(payloads)+1), int32(len(m.Payload))
			payloads = append(payloads, m.Payload...)
		}
		args := []any{pq.Array(ids), payloads, at, lens}
		if w.raw != nil {
			_, err = tx.StmtContext(ctx, w.raw).ExecContext(ctx, args...)
		} else {
			_, err = tx.ExecContext(ctx, rawInsert, args...)
		}
		if err != nil {
			return err
		}
	default:
		return fmt.Errorf("unknown write implementation %q", impl)
	}
	return tx.Commit()
}

// writeCell measures committed messages/s of writers concurrent writers,
// perTx messages per transaction, for dur, in a fresh schema. The keyed
// implementations give every message one of keys ordering keys, at random.
func writeCell(ctx context.Context, e *env, impl string, writers, perTx, keys int, dur time.Duration, payload []byte) (float64, error) {
	s, err := e.newSchema(ctx, writers)
	if err != nil {
		return 0, err
	}
	defer s.drop()
	switch impl {
	case implRaw, implRawPrepared:
		if _, err := s.db.ExecContext(ctx, rawTableDDL); err != nil {
			return 0, err
		}
	case implWatermill:
		if err := initWatermillTables(ctx, s.db); err != nil {
			return 0, err
		}
	}
	wr, err := newWriter(ctx, s.db, impl)
	if err != nil {
		return 0, err
	}
	defer wr.close()
	// Open every connection before the clock starts.
	conns := make([]*sql.Conn, writers)
	for i := range conns {
		if conns[i], err = s.db.Conn(ctx); err != nil {
			return 0, err
		}
	}
	for _, c := range conns {
		_ = c.Close()
	}

	var done atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(dur)
	keyed := impl == implPublisherKeyed || impl == implPublisherLocked
	for w := range writers {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(w), uint64(start.UnixNano())))
			for time.Now().Before(deadline) {
				msgs := newMessages(perTx, payload)
				if keyed {
					for _, m := range msgs {
						envelope.SetOrderingKey(m, "k"+strconv.Itoa(rnd.IntN(max(1, keys))))
					}
				}
				if err := wr.writeTx(ctx, msgs); err != nil {
					once.Do(func() { firstErr = err })
					return
				}
				done.Add(int64(perTx))
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return 0, fmt.Errorf("write %s w%d b%d: %w", impl, writers, perTx, firstErr)
	}
	return float64(done.Load()) / elapsed.Seconds(), nil
}
