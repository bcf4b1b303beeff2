// Command router-migration is a watermill service that used
// components/forwarder with watermill-sql, moved to the fenced outbox.
// The README shows the diff from the "before" version. What changed:
//
//   - the watermill-sql publisher stays; only its schema adapter changes
//     (sqlv4.Schema writes into messaging_outbox), and the components/forwarder
//     envelope publisher around it goes away;
//   - the components/forwarder Forwarder and its watermill-sql subscriber
//     are replaced by forwarder.New(...).RouterPlugin(): the relay starts and
//     drains with the router;
//   - the tables come from migrations.Up instead of watermill-sql's schema
//     auto-initialisation;
//   - each topic keeps its order: sqlv4.Schema keys messages without an
//     ordering key by their topic (publisher.Config.KeyUnkeyedByTopic; off
//     with sqlv4.Schema{UnorderedTopics: true}), so the relay publishes a
//     topic one message after another, as components/forwarder did.
//
// Downstream is watermill's in-memory GoChannel, so it runs anywhere.
// PostgreSQL comes from OUTBOX_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable); the tables go
// into the URL's search_path schema, or "outbox_demo_router".
package main

import (
	"cmp"
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/publisher/sqlv4"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultSchema      = "outbox_demo_router"
	topic              = "orders.placed"
)

const (
	createOrders = `CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, amount_cents bigint NOT NULL CHECK (amount_cents > 0))`
	insertOrder  = `INSERT INTO orders (id, amount_cents) VALUES ($1, $2)`
)

// maxOrderCents is the business rule that rolls an order back.
const maxOrderCents = 1000_00

var errTooLarge = errors.New("order amount above the limit")

// placeOrder writes the order and publishes OrderPlaced through
// watermill-sql's publisher on the same transaction.
func placeOrder(ctx context.Context, db *stdsql.DB, logger watermill.LoggerAdapter, orderID string, amountCents int64) (eventID string, err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	if _, err = tx.ExecContext(ctx, insertOrder, orderID, amountCents); err != nil {
		return "", err
	}

	pub, err := sql.NewPublisher(sql.TxFromStdSQL(tx), sql.PublisherConfig{
		SchemaAdapter: sqlv4.Schema{Config: publisher.Config{Producer: "orders", Notify: true}},
	}, logger)
	if err != nil {
		return "", err
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order_id":%q,"amount_cents":%d}`, orderID, amountCents)))
	msg.Metadata.Set("origin", "checkout")
	envelope.SetMessageType(msg, "OrderPlaced")
	if err = pub.Publish(topic, msg); err != nil {
		return "", err
	}
	if amountCents > maxOrderCents {
		return "", errTooLarge // the order row and the event roll back together
	}
	return msg.UUID, tx.Commit()
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	if err := run(ctx, cmp.Or(os.Getenv("OUTBOX_DATABASE_URL"), defaultDatabaseURL)); err != nil {
		fmt.Fprintln(os.Stderr, "router-migration failed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dbURL string) error {
	logger := watermill.NopLogger{}
	dsn, schema, err := withSchema(dbURL)
	if err != nil {
		return err
	}
	db, err := stdsql.Open("postgres", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(4)
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+pq.QuoteIdentifier(schema)); err != nil {
		return fmt.Errorf("is PostgreSQL running? (`make db`): %w", err)
	}
	if _, err := migrations.Up(ctx, db); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, createOrders); err != nil {
		return err
	}
	fmt.Printf("== database schema %s (migrated)\n", schema)

	downstream := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}

	relay, err := forwarder.New(db, downstream, logger, forwarder.Config{ListenURL: dsn})
	if err != nil {
		return err
	}
	router.AddPlugin(relay.RouterPlugin())

	// The existing consumer, unchanged by the migration.
	got := make(chan *message.Message, 64)
	router.AddConsumerHandler("notify-customer", topic, downstream, func(msg *message.Message) error {
		got <- msg
		return nil
	})

	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(context.WithoutCancel(ctx)) }()
	stopRouter := sync.OnceValue(func() error {
		_ = router.Close() // closes the relay through its plugin, draining it
		return <-routerDone
	})
	defer stopRouter()
	select {
	case <-relay.Running():
	case <-ctx.Done():
		return fmt.Errorf("router and relay did not start: %w", ctx.Err())
	}

	fmt.Println("\n== placing orders")
	runID := strings.ToLower(watermill.NewShortUUID()[:8])
	want := map[string]string{} // event id -> order id
	var rolledBack []string
	for i, amount := range []int64{42_00, 2500_00, 17_50} {
		orderID := fmt.Sprintf("ord-%s-%d", runID, i+1)
		eventID, err := placeOrder(ctx, db, logger, orderID, amount)
		switch {
		case errors.Is(err, errTooLarge):
			rolledBack = append(rolledBack, orderID)
			fmt.Printf("order    %s amount=%d -> rolled back (%v)\n", orderID, amount, err)
		case err != nil:
			return err
		default:
			want[eventID] = orderID
			fmt.Printf("order    %s amount=%d -> committed, event %s\n", orderID, amount, eventID)
		}
	}

	fmt.Println("\n== relay (router plugin) -> GoChannel -> handler")
	received := map[string]int{}
	rolledBackSeen := 0
	var timedOut error
collect:
	for n := 0; n < len(want); {
		select {
		case msg := <-got:
			fmt.Printf("handler  <- %s %s %s origin=%s producer=%s\n", msg.Metadata.Get(envelope.KeyMessageType), msg.UUID,
				msg.Payload, msg.Metadata.Get("origin"), msg.Metadata.Get(envelope.KeyProducer))
			for _, id := range rolledBack {
				if strings.Contains(string(msg.Payload), id) {
					rolledBackSeen++
				}
			}
			if _, ok := want[msg.UUID]; ok {
				if received[msg.UUID]++; received[msg.UUID] == 1 {
					n++
				}
			}
		case <-ctx.Done():
			timedOut = ctx.Err()
			break collect
		}
	}
	if err := stopRouter(); err != nil {
		return err
	}
	fmt.Println("\n== result")
	fmt.Printf("received %d of %d, rolled back %d\n", len(received), len(want), rolledBackSeen)
	if timedOut != nil || len(received) != len(want) || rolledBackSeen != 0 {
		return errors.New("the handler did not get exactly the committed events")
	}
	return nil
}

func withSchema(rawURL string) (string, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", "", errors.New("OUTBOX_DATABASE_URL must be a postgres:// URL")
	}
	q := u.Query()
	schema := strings.Trim(strings.TrimSpace(strings.Split(q.Get("search_path"), ",")[0]), `"`)
	if schema == "" {
		schema = defaultSchema
		q.Set("search_path", schema)
		u.RawQuery = q.Encode()
	}
	return u.String(), schema, nil
}
