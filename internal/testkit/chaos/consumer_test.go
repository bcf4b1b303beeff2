package chaos_test

import (
	"database/sql"
	"encoding/json"
	"errors"
	mrand "math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/inbox"
)

// The consumer side: the downstream's delivery log (chaos_delivery) is
// the broker, and consumer workers receive every delivery (duplicates
// included) at least once, as from a broker with acknowledgements: each
// worker takes the unacknowledged deliveries whose id is its own modulo the
// worker count, hands each to the inbox middleware, whose handler writes
// the message's effect (chaos_effect) in the inbox's transaction, and acks
// the batch (chaos_ack) once handled; so two deliveries of one message may
// be handled by two workers at once. (Not an offset on the identity
// column: ids are taken at insert and commit out of order, so a consumer
// that moves an offset past a visible id skips one that commits later.)
// Consumer faults: a handler that fails after writing its effect (the
// transaction rolls back; the delivery is handled again), and a worker
// that crashes before acking (its batch comes again: more duplicates). The
// check: every delivered message has exactly one effect, however many
// deliveries of it arrived.
const consumerWorkers = 3

const consumerName = "chaos-consumer"

type consumer struct {
	t    *testing.T
	db   *sql.DB
	mw   message.HandlerMiddleware
	seed uint64

	finishing chan struct{}

	mu                     sync.Mutex
	handled                int // deliveries handed to the inbox (replays included)
	handlerErrors, crashes int
	replayed               int // deliveries handed again after a crash
}

func newConsumer(t *testing.T, db *sql.DB, seed uint64) *consumer {
	mw, err := inbox.NewMiddleware(db, consumerName, inbox.Config{})
	if err != nil {
		t.Fatalf("inbox.NewMiddleware: %v", err)
	}
	return &consumer{t: t, db: db, mw: mw, seed: seed, finishing: make(chan struct{})}
}

// finish tells the workers that no delivery comes any more: they read to
// the end of the log and return.
func (c *consumer) finish() { close(c.finishing) }

func (c *consumer) run() {
	var wg sync.WaitGroup
	for w := range consumerWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.work(w)
		}()
	}
	wg.Wait()
}

var errHandlerFault = errors.New("chaos consumer: handler failed after writing its effect")

func (c *consumer) work(w int) {
	rng := mrand.New(mrand.NewPCG(c.seed, 0xc0+uint64(w)))
	var failNext bool
	h := c.mw(func(msg *message.Message) ([]*message.Message, error) {
		tx := inbox.Tx(msg.Context())
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO chaos_effect (message_id, worker) VALUES ($1, $2)`, msg.UUID, w); err != nil {
			return nil, err
		}
		if failNext {
			return nil, errHandlerFault
		}
		return nil, nil
	})
	poll := time.NewTicker(50 * time.Millisecond)
	defer poll.Stop()
	seen := map[int64]bool{}
	for {
		// finishing is read before the log: once it is closed every
		// delivery is in the log, so an empty read after it is the end.
		var last bool
		select {
		case <-c.finishing:
			last = true
		default:
		}
		rows, err := c.db.Query(`SELECT d.delivery_id, d.message_id, d.logical_id FROM chaos_delivery d
			WHERE d.delivery_id % $1 = $2 AND NOT EXISTS (SELECT 1 FROM chaos_ack a WHERE a.delivery_id = d.delivery_id)
			ORDER BY d.delivery_id LIMIT 50`, consumerWorkers, w)
		if err != nil {
			c.t.Errorf("consumer %d: read the log: %v", w, err)
			return
		}
		type del struct {
			id             int64
			msgID, logical string
		}
		var batch []del
		for rows.Next() {
			var d del
			if err := rows.Scan(&d.id, &d.msgID, &d.logical); err != nil {
				c.t.Errorf("consumer %d: scan: %v", w, err)
				_ = rows.Close()
				return
			}
			batch = append(batch, d)
		}
		if err := rows.Err(); err != nil {
			c.t.Errorf("consumer %d: read the log: %v", w, err)
			return
		}
		if len(batch) == 0 {
			if last {
				return
			}
			<-poll.C
			continue
		}
		for _, d := range batch {
			payload, _ := json.Marshal(map[string]any{"id": d.logical})
			if seen[d.id] {
				c.mu.Lock()
				c.replayed++ // handed again after a crash
				c.mu.Unlock()
			}
			seen[d.id] = true
			for {
				msg := message.NewMessage(d.msgID, payload)
				failNext = rng.IntN(20) == 0
				_, err := h(msg)
				c.mu.Lock()
				c.handled++
				c.mu.Unlock()
				if err == nil {
					break
				}
				if !errors.Is(err, errHandlerFault) {
					c.t.Errorf("consumer %d: delivery %d of %s: %v", w, d.id, d.msgID, err)
					return
				}
				c.mu.Lock()
				c.handlerErrors++
				c.mu.Unlock()
			}
		}
		if rng.IntN(25) == 0 {
			// A crash before the ack: the batch comes again.
			c.mu.Lock()
			c.crashes++
			c.mu.Unlock()
			continue
		}
		ids := make([]int64, len(batch))
		for i, d := range batch {
			ids[i] = d.id
		}
		if _, err := c.db.Exec(`INSERT INTO chaos_ack (delivery_id) SELECT unnest($1::bigint[])`, pq.Array(ids)); err != nil {
			c.t.Errorf("consumer %d: ack: %v", w, err)
			return
		}
	}
}
