package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"net/http"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// The write side: the order service. Copy this part into a service that
// owns a database/sql handle; nothing here knows about Pub/Sub.

const (
	ordersTopic      = "orders"
	producerName     = "orders-service"
	creditLimitCents = 100_00 // per customer, across their orders of one run
)

const (
	insertOrder = `INSERT INTO orders (id, customer_id, tenant, item, quantity, total_cents) VALUES ($1, $2, $3, $4, $5, $6)`
	// Runs after the insert, inside the same transaction, so it counts the
	// new order too. Order ids are "ord-<run>-<n>" and the demo schema keeps
	// earlier runs' orders, so the limit counts this run's orders only
	// ($2 is the "ord-<run>-" prefix): every run of the demo behaves the same.
	customerTotal = `SELECT sum(total_cents) FROM orders WHERE customer_id = $1 AND starts_with(id, $2)`
)

// errCreditLimit is the business rule that rolls an order back.
var errCreditLimit = errors.New("order total exceeds the customer's credit limit")

// OrderRequest is the body of POST /orders.
type OrderRequest struct {
	Customer       string `json:"customer"`
	Tenant         string `json:"tenant"`
	Item           string `json:"item"`
	Quantity       int    `json:"quantity"`
	UnitPriceCents int64  `json:"unit_price_cents"`
}

// OrderPlaced is the event payload.
type OrderPlaced struct {
	OrderID    string `json:"order_id"`
	Customer   string `json:"customer"`
	Item       string `json:"item"`
	Quantity   int    `json:"quantity"`
	TotalCents int64  `json:"total_cents"`
}

// OrderResponse is what POST /orders answers with 201.
type OrderResponse struct {
	OrderID string `json:"order_id"`
	EventID string `json:"event_id"`
}

// placeOrder is the business transaction: the order row and its OrderPlaced
// event commit together or not at all. The publisher writes the event into
// messaging_outbox with the caller's transaction; nothing is sent to a
// broker here, so a broker outage cannot fail (or half-apply) an order.
func placeOrder(ctx context.Context, db *sql.DB, prep *publisher.Prepared, orderID, correlationID string, req OrderRequest) (eventID string, err error) {
	total := int64(req.Quantity) * req.UnitPriceCents
	cfg := publisher.Config{
		Producer: producerName,
		Prepared: prep,
		// Wake the relay (it LISTENs) the moment this transaction commits;
		// PostgreSQL drops the notification on rollback.
		Notify: true,
	}
	err = publisher.InTx(ctx, db, cfg, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
		if _, err := tx.ExecContext(ctx, insertOrder, orderID, req.Customer, req.Tenant, req.Item, req.Quantity, total); err != nil {
			return err
		}
		payload, err := json.Marshal(OrderPlaced{OrderID: orderID, Customer: req.Customer, Item: req.Item, Quantity: req.Quantity, TotalCents: total})
		if err != nil {
			return err
		}
		msg := message.NewMessage(watermill.NewULID(), payload)
		envelope.SetMessageType(msg, "OrderPlaced")
		envelope.SetContentType(msg, "application/json")
		envelope.SetTenant(msg, req.Tenant)
		envelope.SetCorrelationID(msg, correlationID)
		envelope.SetAggregate(msg, "order", orderID, 1)
		// One customer's events leave the outbox in commit order (ordering
		// key) and keep that order in Pub/Sub (partition key -> ordering key).
		envelope.SetOrderingKey(msg, req.Customer)
		envelope.SetPartitionKey(msg, req.Customer)
		if err := pub.Publish(ordersTopic, msg); err != nil {
			return err
		}
		eventID = msg.UUID

		// The rule is checked last on purpose: when it fails, the order row
		// and the event row written above disappear with the rollback.
		var sum int64
		if err := tx.QueryRowContext(ctx, customerTotal, req.Customer, orderID[:strings.LastIndex(orderID, "-")+1]).Scan(&sum); err != nil {
			return err
		}
		if sum > creditLimitCents {
			return errCreditLimit
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	return eventID, nil
}

// orderHandler is the HTTP front of the service: POST /orders.
func orderHandler(db *sql.DB, prep *publisher.Prepared) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST only", http.StatusMethodNotAllowed)
			return
		}
		var req OrderRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, "bad order: "+err.Error(), http.StatusBadRequest)
			return
		}
		if req.Customer == "" || req.Quantity <= 0 || req.UnitPriceCents < 0 {
			http.Error(w, "customer, a positive quantity and a price are required", http.StatusBadRequest)
			return
		}
		if err := envelope.ValidateTenant(req.Tenant); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		orderID := r.Header.Get("Idempotency-Key")
		if orderID == "" {
			orderID = "ord-" + watermill.NewShortUUID()
		}
		correlationID := r.Header.Get("X-Correlation-ID")
		if correlationID == "" {
			correlationID = watermill.NewShortUUID()
		}
		eventID, err := placeOrder(r.Context(), db, prep, orderID, correlationID, req)
		switch {
		case errors.Is(err, errCreditLimit):
			http.Error(w, err.Error(), http.StatusUnprocessableEntity)
			return
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(OrderResponse{OrderID: orderID, EventID: eventID})
	})
}
