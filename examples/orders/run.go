package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
)

// transcript serialises output from the relay, the consumer and main.
type transcript struct {
	mu sync.Mutex
	w  io.Writer
}

func (t *transcript) printf(format string, args ...any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	fmt.Fprintf(t.w, format, args...)
}

// The orders the demo places. The third order for bob pushes him over the
// credit limit, so its transaction rolls back: neither the order nor its
// event may ever be seen downstream.
var demoOrders = []struct {
	OrderRequest
	correlation string
}{
	{OrderRequest{Customer: "ada", Tenant: "acme", Item: "widget", Quantity: 2, UnitPriceCents: 12_50}, "req-ada-1"},
	{OrderRequest{Customer: "bob", Tenant: "globex", Item: "gadget", Quantity: 1, UnitPriceCents: 40_00}, "req-bob-1"},
	{OrderRequest{Customer: "ada", Tenant: "acme", Item: "sprocket", Quantity: 3, UnitPriceCents: 5_00}, "req-ada-2"},
	{OrderRequest{Customer: "cyd", Tenant: "acme", Item: "widget", Quantity: 1, UnitPriceCents: 12_50}, "req-cyd-1"},
	{OrderRequest{Customer: "bob", Tenant: "globex", Item: "gizmo", Quantity: 9, UnitPriceCents: 9_00}, "req-bob-2"},
}

// Read-only checks at the end; they look at this run's orders only.
const (
	selectRunEvents = `SELECT aggregate_id, message_id, status, attempts FROM messaging_outbox
WHERE destination = $1 AND aggregate_id LIKE $2 ORDER BY seq`
	countOrder    = `SELECT count(*) FROM orders WHERE id = $1`
	countEventOf  = `SELECT count(*) FROM messaging_outbox WHERE aggregate_id = $1`
	countShipment = `SELECT count(*) FROM shipments WHERE order_id = $1`
	// The inbox rows of this run's events.
	countInbox = `SELECT count(*) FROM messaging_inbox
WHERE consumer = $1 AND message_id IN (SELECT message_id FROM messaging_outbox WHERE aggregate_id = ANY($2))`
)

func run(ctx context.Context, dbURL string, w io.Writer) error {
	out := &transcript{w: w}
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	runID := "ord-" + strings.ToLower(watermill.NewShortUUID()[:8]) + "-"

	// 1. Database: migrate the outbox and create the business tables.
	db, dsn, err := openDatabase(ctx, dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	// The outbox INSERTs as prepared statements, once for the pool: one
	// round trip per Publish and no re-planning (leave it out behind a
	// pooler that cannot carry prepared statements).
	prep, err := publisher.Prepare(ctx, db)
	if err != nil {
		return err
	}
	defer prep.Close()
	_, schema, _ := withSchema(dbURL)
	out.printf("== database: %s, schema %s (migrated)\n", redact(dbURL), schema)

	// 2. Pub/Sub and the shipping consumer on a watermill router.
	ps, err := connectPubSub()
	if err != nil {
		return err
	}
	defer ps.close()
	out.printf("== downstream: %s, topic %q, subscription %q\n", ps.where, ordersTopic, ordersTopic+"-shipping")

	sub, err := ps.subscriber(logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	obs := newObserver(out, runID)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	inboxMW, err := inbox.NewMiddleware(db, consumerName, inbox.Config{Logger: logger})
	if err != nil {
		return err
	}
	handler := router.AddConsumerHandler("shipping", ordersTopic, sub, obs.countShipment(shipOrder))
	// First added is outermost: the observer sees every delivery, the inbox
	// decides whether shipOrder runs.
	handler.AddMiddleware(obs.Middleware, inboxMW)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(context.WithoutCancel(ctx)) }()
	stopRouter := sync.OnceValue(func() error {
		_ = router.Close() // also closes the subscriber
		return <-routerDone
	})
	defer stopRouter()
	select {
	case <-router.Running(): // the subscription exists now, so nothing relayed is lost
	case <-ctx.Done():
		return fmt.Errorf("router did not start: %w", ctx.Err())
	}

	// 3. The order service takes orders over HTTP. The relay is not running
	// yet, so the transcript shows what the outbox holds before relaying.
	srv := httptest.NewServer(orderHandler(db, prep))
	defer srv.Close()
	out.printf("\n== placing orders (POST %s/orders)\n", srv.URL)
	var committed, rolledBack []string
	for i, o := range demoOrders {
		orderID := fmt.Sprintf("%s%d", runID, i+1)
		status, body, err := postOrder(ctx, srv.URL, orderID, o.correlation, o.OrderRequest)
		if err != nil {
			return err
		}
		line := fmt.Sprintf("service  %s customer=%s tenant=%s %dx%s correlation=%s -> %d", orderID, o.Customer, o.Tenant, o.Quantity, o.Item, o.correlation, status)
		switch status {
		case http.StatusCreated:
			var resp OrderResponse
			if err := json.Unmarshal(body, &resp); err != nil {
				return err
			}
			committed = append(committed, orderID)
			obs.expect(orderID)
			out.printf("%s committed, event %s in the outbox\n", line, resp.EventID)
		case http.StatusUnprocessableEntity:
			rolledBack = append(rolledBack, orderID)
			out.printf("%s ROLLED BACK (%s): the order row and its event are gone\n", line, strings.TrimSpace(string(body)))
		default:
			return fmt.Errorf("POST /orders for %s: %d %s", orderID, status, body)
		}
	}
	if len(committed) == 0 || len(rolledBack) == 0 {
		return fmt.Errorf("the demo needs committed and rolled-back orders, got %d and %d", len(committed), len(rolledBack))
	}
	// The first order's first ack will be "lost", so Pub/Sub delivers it twice.
	obs.mu.Lock()
	obs.loseAckOf = committed[0]
	obs.mu.Unlock()

	out.printf("\n== committed in PostgreSQL (messaging_outbox, this run)\n")
	if err := printOutbox(ctx, db, out, runID); err != nil {
		return err
	}

	// 4. The relay: claims committed rows (fenced leases), publishes them to
	// Pub/Sub, writes each outcome. It LISTENs for the publisher's NOTIFY.
	pub, err := ps.publisher(logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	relay, err := forwarder.New(db, pub, logger, forwarder.Config{
		Classifier:   googlecloud.Classify,
		ListenURL:    dsn,
		PollInterval: 100 * time.Millisecond,
		OnReport: func(r forwarder.Report) {
			if r.Claimed == 0 && r.Stale == 0 {
				return // idle passes say nothing
			}
			out.printf("relay    pass: claimed=%d published=%d ambiguous=%d failed=%d exhausted=%d stale=%d released=%d (%s)\n",
				r.Claimed, r.Published, r.Ambiguous, r.Failed, r.Exhausted, r.Stale, r.Released, r.Duration.Round(time.Millisecond))
		},
	})
	if err != nil {
		return err
	}
	out.printf("\n== relaying (forwarder %s) and consuming; %s's first delivery simulates a crash after commit, before ack\n", relay.Owner(), obs.loseAckOf)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(context.WithoutCancel(ctx)) }()

	var waitErr error
	select {
	case <-obs.done:
	case err := <-relayDone:
		waitErr = fmt.Errorf("relay stopped: %v", err)
	case <-ctx.Done():
		waitErr = fmt.Errorf("gave up waiting for the consumer: %w", ctx.Err())
	}
	_ = relay.Close() // drains the pass in progress; idempotent
	if err := stopRouter(); err != nil {
		return fmt.Errorf("router: %w", err)
	}

	// 5. The verdict comes from the database and the observer, not from
	// the transcript.
	out.printf("\n== after relaying\n")
	if err := printOutbox(ctx, db, out, runID); err != nil {
		return err
	}
	return verdict(context.WithoutCancel(ctx), db, out, obs, committed, rolledBack, waitErr)
}

func postOrder(ctx context.Context, base, orderID, correlation string, req OrderRequest) (int, []byte, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return 0, nil, err
	}
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/orders", bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Idempotency-Key", orderID)
	r.Header.Set("X-Correlation-ID", correlation)
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func printOutbox(ctx context.Context, db *sql.DB, out *transcript, runID string) error {
	rows, err := db.QueryContext(ctx, selectRunEvents, ordersTopic, runID+"%")
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var orderID, msgID, status string
		var attempts int
		if err := rows.Scan(&orderID, &msgID, &status, &attempts); err != nil {
			return err
		}
		out.printf("outbox   %s event %s status=%s attempts=%d\n", orderID, msgID, status, attempts)
	}
	return rows.Err()
}

// verdict checks that every committed order was shipped exactly once and
// that the rolled-back order left no trace, prints the summary and returns
// an error when anything is off.
func verdict(ctx context.Context, db *sql.DB, out *transcript, obs *observer, committed, rolledBack []string, waitErr error) error {
	obs.mu.Lock()
	defer obs.mu.Unlock()
	var problems []string
	if waitErr != nil {
		problems = append(problems, waitErr.Error())
	}
	count := func(q string, args ...any) int {
		var n int
		if err := db.QueryRowContext(ctx, q, args...).Scan(&n); err != nil {
			problems = append(problems, err.Error())
		}
		return n
	}
	exactlyOnce, deliveries := 0, 0
	for _, id := range committed {
		deliveries += obs.deliveries[id]
		shipments := count(countShipment, id)
		if shipments == 1 && obs.shipped[id] == 1 {
			exactlyOnce++
		} else {
			problems = append(problems, fmt.Sprintf("%s: %d deliveries, %d handler runs, %d shipments (want 1 shipment)", id, obs.deliveries[id], obs.shipped[id], shipments))
		}
	}
	receivedRolledBack := 0
	for _, id := range rolledBack {
		if obs.deliveries[id] > 0 || count(countShipment, id) > 0 {
			receivedRolledBack++
			problems = append(problems, fmt.Sprintf("%s was rolled back but reached the consumer", id))
		}
		if count(countOrder, id) != 0 || count(countEventOf, id) != 0 {
			problems = append(problems, fmt.Sprintf("%s was rolled back but its order or event row exists", id))
		}
	}
	if !obs.dupSkipped {
		problems = append(problems, fmt.Sprintf("the redelivery of %s was not seen skipped by the inbox", obs.loseAckOf))
	}
	var inboxRows int
	if len(committed) > 0 {
		inboxRows = count(countInbox, consumerName, pq.Array(committed))
	}

	out.printf("\n== result\n")
	out.printf("committed orders:            %d\n", len(committed))
	out.printf("rolled-back orders:          %d (never in the outbox, never delivered)\n", len(rolledBack))
	out.printf("deliveries to the consumer:  %d (at least once: %s was delivered twice)\n", deliveries, obs.loseAckOf)
	out.printf("shipments created:           %d, inbox records: %d (the inbox skipped the duplicate)\n", exactlyOnce, inboxRows)
	for _, p := range problems {
		out.printf("PROBLEM: %s\n", p)
	}
	out.printf("received %d of %d, rolled back %d\n", exactlyOnce, len(committed), receivedRolledBack)
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}
