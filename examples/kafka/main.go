// Command kafka is the orders flow with Kafka downstream: a business
// transaction writes an order and its OrderPlaced event (the outbox), the
// fenced relay publishes committed events to Kafka with the customer as the
// record key (one customer -> one partition, in commit order), and a
// shipping consumer on a watermill router creates one shipment per order
// through the inbox.
//
// Kafka is in-process (franz-go's kfake, topic "orders" with 4 partitions)
// unless KAFKA_BROKERS (comma-separated host:port) names a real cluster;
// there the topic "orders" must exist (the relay does not create topics).
// PostgreSQL comes from OUTBOX_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable); the tables go
// into the URL's search_path schema, or "outbox_demo_kafka".
package main

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wk "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/transport/kafka"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultSchema      = "outbox_demo_kafka"
	topic              = "orders"
	consumerName       = "shipping"
	creditLimitCents   = 100_00
)

const (
	createTables = `
CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, customer_id text NOT NULL, total_cents bigint NOT NULL);
CREATE TABLE IF NOT EXISTS shipments (order_id text PRIMARY KEY, customer_id text NOT NULL);`
	insertOrder = `INSERT INTO orders (id, customer_id, total_cents) VALUES ($1, $2, $3)`
	// The schema keeps earlier runs' orders; the limit counts this run's
	// ("ord-<run>-" prefix, $2) so every run behaves the same.
	customerTotal  = `SELECT sum(total_cents) FROM orders WHERE customer_id = $1 AND starts_with(id, $2)`
	insertShipment = `INSERT INTO shipments (order_id, customer_id) VALUES ($1, $2)`
	countShipment  = `SELECT count(*) FROM shipments WHERE order_id = $1`
	countEventOf   = `SELECT count(*) FROM messaging_outbox WHERE aggregate_id = $1`
)

var errCreditLimit = errors.New("order total exceeds the customer's credit limit")

// OrderPlaced is the event payload.
type OrderPlaced struct {
	OrderID    string `json:"order_id"`
	Customer   string `json:"customer"`
	TotalCents int64  `json:"total_cents"`
}

// placeOrder is the business transaction: order row and event together.
func placeOrder(ctx context.Context, db *sql.DB, orderID, customer, tenant, correlation string, totalCents int64) error {
	cfg := publisher.Config{Producer: "orders-service", Notify: true}
	return publisher.InTx(ctx, db, cfg, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
		if _, err := tx.ExecContext(ctx, insertOrder, orderID, customer, totalCents); err != nil {
			return err
		}
		payload, err := json.Marshal(OrderPlaced{OrderID: orderID, Customer: customer, TotalCents: totalCents})
		if err != nil {
			return err
		}
		msg := message.NewMessage(watermill.NewULID(), payload)
		envelope.SetMessageType(msg, "OrderPlaced")
		envelope.SetTenant(msg, tenant)
		envelope.SetCorrelationID(msg, correlation)
		envelope.SetAggregate(msg, "order", orderID, 1)
		envelope.SetOrderingKey(msg, customer)  // the relay keeps the customer's commit order
		envelope.SetPartitionKey(msg, customer) // the Kafka record key: one customer, one partition
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
		var sum int64
		if err := tx.QueryRowContext(ctx, customerTotal, customer, orderID[:strings.LastIndex(orderID, "-")+1]).Scan(&sum); err != nil {
			return err
		}
		if sum > creditLimitCents {
			return errCreditLimit // order row and event roll back together
		}
		return nil
	})
}

// shipOrder is the consumer's effect, written in the inbox's transaction.
func shipOrder(msg *message.Message) error {
	var ev OrderPlaced
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return err
	}
	_, err := inbox.Tx(msg.Context()).ExecContext(msg.Context(), insertShipment, ev.OrderID, ev.Customer)
	return err
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	if err := run(ctx, cmp.Or(os.Getenv("OUTBOX_DATABASE_URL"), defaultDatabaseURL)); err != nil {
		fmt.Fprintln(os.Stderr, "kafka example failed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dbURL string) error {
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	db, schema, err := openDatabase(ctx, dbURL)
	if err != nil {
		return err
	}
	defer db.Close()

	brokers, where := strings.Split(os.Getenv("KAFKA_BROKERS"), ","), "Kafka at "+os.Getenv("KAFKA_BROKERS")+" (KAFKA_BROKERS)"
	if os.Getenv("KAFKA_BROKERS") == "" {
		addrs, stop, err := inProcessKafka(topic, 4)
		if err != nil {
			return err
		}
		defer stop()
		brokers, where = addrs, "in-process Kafka (kfake, 4 partitions; set KAFKA_BROKERS for a real cluster)"
	}
	fmt.Printf("== database schema %s (migrated); downstream %s, topic %q\n", schema, where, topic)

	// The consumer: a watermill-kafka consumer group on a router.
	subCfg := wk.DefaultSaramaSubscriberConfig()
	subCfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := wk.NewSubscriber(wk.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.Marshaler(), OverwriteSaramaConfig: subCfg,
		ConsumerGroup: consumerName, NackResendSleep: 50 * time.Millisecond,
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	inboxMW, err := inbox.NewMiddleware(db, consumerName, inbox.Config{Logger: logger})
	if err != nil {
		return err
	}
	var (
		mu         sync.Mutex
		deliveries = map[string]int{}
		shipped    = map[string]int{}
		loseAckOf  string
		dupSkipped bool
		progress   = make(chan struct{}, 64)
	)
	counted := func(msg *message.Message) error {
		err := shipOrder(msg)
		if err == nil {
			mu.Lock()
			shipped[msg.Metadata.Get(envelope.KeyAggregateID)]++
			mu.Unlock()
		}
		return err
	}
	// Outside the inbox: print every delivery, and "lose" the first ack of
	// one order (as a consumer that crashed after commit would), so Kafka's
	// consumer delivers it again and the inbox has something to skip.
	observe := func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			id := msg.Metadata.Get(envelope.KeyAggregateID)
			partition, _ := wk.MessagePartitionFromCtx(msg.Context())
			offset, _ := wk.MessagePartitionOffsetFromCtx(msg.Context())
			mu.Lock()
			deliveries[id]++
			n, before := deliveries[id], shipped[id]
			mu.Unlock()
			fmt.Printf("consumer <- %s %s (event %s, delivery %d) key=%s partition=%d offset=%d tenant=%s correlation=%s\n",
				msg.Metadata.Get(envelope.KeyMessageType), id, msg.UUID, n, msg.Metadata.Get(envelope.KeyPartitionKey),
				partition, offset, msg.Metadata.Get(envelope.KeyTenant), msg.Metadata.Get(envelope.KeyCorrelationID))
			produced, err := next(msg)
			mu.Lock()
			defer mu.Unlock()
			defer func() { progress <- struct{}{} }()
			switch {
			case err != nil:
				fmt.Printf("consumer    %s: failed (%v), rolled back, nacked\n", id, err)
			case shipped[id] > before && id == loseAckOf && n == 1:
				fmt.Printf("consumer    %s: shipment committed, then a simulated crash before the ack: nack, Kafka consumer redelivers\n", id)
				return produced, errors.New("simulated crash between commit and ack")
			case shipped[id] > before:
				fmt.Printf("consumer    %s: shipment created, acked\n", id)
			default:
				fmt.Printf("consumer    %s: inbox already holds %s -> handler skipped, acked\n", id, msg.UUID)
				dupSkipped = dupSkipped || id == loseAckOf
			}
			return produced, err
		}
	}
	router.AddConsumerHandler("shipping", topic, sub, counted).AddMiddleware(observe, inboxMW)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(context.WithoutCancel(ctx)) }()
	stopRouter := sync.OnceValue(func() error { _ = router.Close(); return <-routerDone })
	defer stopRouter()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return ctx.Err()
	}

	fmt.Println("\n== placing orders")
	runID := "ord-" + strings.ToLower(watermill.NewShortUUID()[:8]) + "-"
	var committed, rolledBack []string
	for i, o := range []struct {
		customer, tenant string
		cents            int64
	}{{"ada", "acme", 25_00}, {"bob", "globex", 40_00}, {"ada", "acme", 15_00}, {"cyd", "acme", 12_50}, {"bob", "globex", 81_00}} {
		id := fmt.Sprintf("%s%d", runID, i+1)
		correlation := fmt.Sprintf("req-%s-%d", o.customer, i+1)
		err := placeOrder(ctx, db, id, o.customer, o.tenant, correlation, o.cents)
		switch {
		case errors.Is(err, errCreditLimit):
			rolledBack = append(rolledBack, id)
			fmt.Printf("service  %s customer=%s total=%d -> ROLLED BACK (%v)\n", id, o.customer, o.cents, err)
		case err != nil:
			return err
		default:
			committed = append(committed, id)
			fmt.Printf("service  %s customer=%s total=%d correlation=%s -> committed\n", id, o.customer, o.cents, correlation)
		}
	}
	mu.Lock()
	loseAckOf = committed[0]
	mu.Unlock()

	pub, err := kafka.NewPublisher(kafka.Config{Brokers: brokers}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	relay, err := forwarder.New(db, pub, logger, forwarder.Config{
		Classifier: kafka.Classify, PollInterval: 100 * time.Millisecond,
		OnReport: func(r forwarder.Report) {
			if r.Claimed > 0 || r.Stale > 0 {
				fmt.Printf("relay    pass: claimed=%d published=%d ambiguous=%d failed=%d exhausted=%d stale=%d (%s)\n",
					r.Claimed, r.Published, r.Ambiguous, r.Failed, r.Exhausted, r.Stale, r.Duration.Round(time.Millisecond))
			}
		},
	})
	if err != nil {
		return err
	}
	fmt.Printf("\n== relaying and consuming (%s's first delivery simulates a crash after commit, before ack)\n", loseAckOf)
	go func() { _ = relay.Run(context.WithoutCancel(ctx)) }()

	finished := func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range committed {
			if shipped[id] == 0 {
				return false
			}
		}
		return dupSkipped
	}
	var waitErr error
	for !finished() && waitErr == nil {
		select {
		case <-progress:
		case <-ctx.Done():
			waitErr = fmt.Errorf("gave up waiting for the consumer: %w", ctx.Err())
		}
	}
	_ = relay.Close()
	if err := stopRouter(); err != nil {
		return err
	}

	// The verdict: shipments in the database, deliveries seen.
	mu.Lock()
	defer mu.Unlock()
	bg := context.WithoutCancel(ctx)
	count := func(q, id string) int {
		var n int
		if err := db.QueryRowContext(bg, q, id).Scan(&n); err != nil {
			waitErr = errors.Join(waitErr, err)
		}
		return n
	}
	once, total, seenRolledBack := 0, 0, 0
	for _, id := range committed {
		total += deliveries[id]
		if count(countShipment, id) == 1 && shipped[id] == 1 {
			once++
		}
	}
	for _, id := range rolledBack {
		seenRolledBack += deliveries[id] + count(countShipment, id) + count(countEventOf, id)
	}
	fmt.Println("\n== result")
	fmt.Printf("deliveries %d for %d committed orders (%s twice, the inbox skipped the second)\n", total, len(committed), loseAckOf)
	fmt.Printf("received %d of %d, rolled back %d\n", once, len(committed), seenRolledBack)
	if waitErr != nil || once != len(committed) || seenRolledBack != 0 || !dupSkipped {
		return errors.Join(errors.New("not every committed order was shipped exactly once"), waitErr)
	}
	return nil
}

// openDatabase connects with search_path set to the URL's schema (or
// defaultSchema), creates it when missing, migrates and creates the tables.
func openDatabase(ctx context.Context, rawURL string) (*sql.DB, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, "", errors.New("OUTBOX_DATABASE_URL must be a postgres:// URL")
	}
	q := u.Query()
	schema := strings.Trim(strings.TrimSpace(strings.Split(q.Get("search_path"), ",")[0]), `"`)
	if schema == "" {
		schema = defaultSchema
		q.Set("search_path", schema)
		u.RawQuery = q.Encode()
	}
	db, err := sql.Open("postgres", u.String())
	if err != nil {
		return nil, "", err
	}
	db.SetMaxOpenConns(6)
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+pq.QuoteIdentifier(schema)); err != nil {
		_ = db.Close()
		return nil, "", fmt.Errorf("%s (is PostgreSQL running? `make db`): %w", u.Redacted(), err)
	}
	if _, err := migrations.Up(ctx, db); err != nil {
		_ = db.Close()
		return nil, "", err
	}
	if _, err := db.ExecContext(ctx, createTables); err != nil {
		_ = db.Close()
		return nil, "", err
	}
	return db, schema, nil
}
