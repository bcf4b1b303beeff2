package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/inbox"
)

// The read side: the shipping service. shipOrder is an ordinary watermill
// handler; the inbox middleware around it runs it inside a transaction that
// also records (consumer, message id), and skips it for an id it has seen.

const (
	consumerName   = "shipping"
	insertShipment = `INSERT INTO shipments (order_id, customer_id) VALUES ($1, $2)`
)

// shipOrder creates the shipment through the inbox's transaction, so the
// shipment and the inbox record commit together.
func shipOrder(msg *message.Message) error {
	var ev OrderPlaced
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return fmt.Errorf("decode OrderPlaced %s: %w", msg.UUID, err)
	}
	tx := inbox.Tx(msg.Context())
	if tx == nil {
		return errors.New("shipOrder must run inside the inbox middleware")
	}
	_, err := tx.ExecContext(msg.Context(), insertShipment, ev.OrderID, ev.Customer)
	return err
}

// errLostAck stands in for a consumer that crashed after its transaction
// committed but before Pub/Sub got the ack: returning an error nacks the
// message, so Pub/Sub delivers it again, exactly as it would after a crash.
var errLostAck = errors.New("simulated crash between commit and ack")

// observer records every delivery for the transcript and the final check.
// It is the outermost middleware, so it sees redeliveries the inbox skips.
type observer struct {
	out *transcript
	run string // order ids of this run start with it

	mu         sync.Mutex
	deliveries map[string]int // order id -> deliveries seen
	shipped    map[string]int // order id -> handler runs that returned nil
	loseAckOf  string         // order id whose first ack is "lost"
	dupSkipped bool
	committed  map[string]bool // order ids the service committed
	done       chan struct{}
	doneOnce   sync.Once
}

func newObserver(out *transcript, run string) *observer {
	return &observer{
		out: out, run: run,
		deliveries: map[string]int{}, shipped: map[string]int{}, committed: map[string]bool{},
		done: make(chan struct{}),
	}
}

// expect registers an order the service committed.
func (o *observer) expect(orderID string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.committed[orderID] = true
}

// countShipment wraps shipOrder to count the handler runs that succeeded.
func (o *observer) countShipment(next message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		err := next(msg)
		if err == nil {
			o.mu.Lock()
			o.shipped[msg.Metadata.Get(envelope.KeyAggregateID)]++
			o.mu.Unlock()
		}
		return err
	}
}

// Middleware goes outside the inbox middleware.
func (o *observer) Middleware(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orderID := msg.Metadata.Get(envelope.KeyAggregateID)
		o.mu.Lock()
		o.deliveries[orderID]++
		n := o.deliveries[orderID]
		before := o.shipped[orderID]
		o.mu.Unlock()

		md := msg.Metadata
		o.out.printf("consumer <- %s %s (event %s, delivery %d) customer=%s tenant=%s correlation=%s ordering-key=%s producer=%s\n",
			md.Get(envelope.KeyMessageType), orderID, msg.UUID, n, customerOf(msg), md.Get(envelope.KeyTenant),
			md.Get(envelope.KeyCorrelationID), md.Get(envelope.KeyPartitionKey), md.Get(envelope.KeyProducer))

		produced, err := next(msg)

		o.mu.Lock()
		defer o.mu.Unlock()
		ranHandler := o.shipped[orderID] > before
		switch {
		case err != nil:
			o.out.printf("consumer    %s: handler failed (%v); rolled back, nacked for redelivery\n", orderID, err)
		case ranHandler && orderID == o.loseAckOf && n == 1:
			o.out.printf("consumer    %s: shipment committed with its inbox record, then %v: nacking, Pub/Sub will deliver it again\n", orderID, errLostAck)
			return produced, errLostAck
		case ranHandler:
			o.out.printf("consumer    %s: shipment created (inbox recorded %s), acked\n", orderID, msg.UUID)
		default:
			o.out.printf("consumer    %s: inbox already holds %s -> handler skipped, no second shipment, acked\n", orderID, msg.UUID)
			if orderID == o.loseAckOf {
				o.dupSkipped = true
			}
		}
		if !o.isRun(orderID) {
			o.out.printf("consumer    (%s is from an earlier run of the demo)\n", orderID)
		}
		o.checkDone()
		return produced, err
	}
}

func (o *observer) isRun(orderID string) bool {
	return len(orderID) > len(o.run) && orderID[:len(o.run)] == o.run
}

// checkDone closes done once every committed order shipped and the
// duplicate delivery was skipped. Called with mu held.
func (o *observer) checkDone() {
	if len(o.committed) == 0 || !o.dupSkipped {
		return
	}
	for id := range o.committed {
		if o.shipped[id] == 0 {
			return
		}
	}
	o.doneOnce.Do(func() { close(o.done) })
}

func customerOf(msg *message.Message) string {
	var ev OrderPlaced
	if json.Unmarshal(msg.Payload, &ev) != nil {
		return "?"
	}
	return ev.Customer
}
