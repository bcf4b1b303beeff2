// Command legacy-sql is a plain database/sql service with no watermill
// router: registerCustomer shows the whole write side (begin, business
// change, outbox publish, commit), and a forwarder drains the outbox to a
// sink (watermill's in-memory GoChannel, printed as a log). Swap the sink
// for a Pub/Sub, Kafka, AMQP or NATS publisher from package transport.
//
// PostgreSQL comes from OUTBOX_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable); the tables go
// into the URL's search_path schema, or "outbox_demo_legacy" (created if
// missing). It exits non-zero unless every committed registration reached
// the sink and the refused one did not.
package main

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultSchema      = "outbox_demo_legacy"
	topic              = "customers.registered"
)

const (
	createCustomers = `CREATE TABLE IF NOT EXISTS customers (
    id    text PRIMARY KEY,
    email text NOT NULL UNIQUE
)`
	insertCustomer = `INSERT INTO customers (id, email) VALUES ($1, $2)`
	countEventsOf  = `SELECT count(*) FROM messaging_outbox WHERE aggregate_id = $1`
)

// CustomerRegistered is the event payload.
type CustomerRegistered struct {
	CustomerID string `json:"customer_id"`
	Email      string `json:"email"`
}

// registerCustomer is the function to copy: the customer row and the
// CustomerRegistered event commit in one transaction or not at all. The
// publisher only writes into messaging_outbox with the caller's tx; it
// never commits or rolls back, and nothing reaches a broker from here.
// (publisher.InTx does the begin/commit/rollback for you; this is the same
// thing spelled out, as legacy code usually is.)
func registerCustomer(ctx context.Context, db *sql.DB, customerID, email string) (eventID string, err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()

	if _, err = tx.ExecContext(ctx, insertCustomer, customerID, email); err != nil {
		return "", err // e.g. the email is taken: the event below is never written
	}

	pub, err := publisher.New(tx, publisher.Config{Producer: "legacy-crm"}, nil)
	if err != nil {
		return "", err
	}
	defer pub.Close()
	payload, err := json.Marshal(CustomerRegistered{CustomerID: customerID, Email: email})
	if err != nil {
		return "", err
	}
	msg := message.NewMessage(watermill.NewUUID(), payload)
	envelope.SetMessageType(msg, "CustomerRegistered")
	envelope.SetContentType(msg, "application/json")
	envelope.SetTenant(msg, "acme")
	envelope.SetAggregate(msg, "customer", customerID, 1)
	if err = pub.Publish(topic, msg); err != nil {
		return "", err
	}
	if err = tx.Commit(); err != nil {
		return "", err
	}
	return msg.UUID, nil
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	if err := run(ctx, cmp.Or(os.Getenv("OUTBOX_DATABASE_URL"), defaultDatabaseURL)); err != nil {
		fmt.Fprintln(os.Stderr, "legacy-sql failed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dbURL string) error {
	db, schema, err := openDatabase(ctx, dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	fmt.Printf("== database schema %s (migrated)\n", schema)

	// The sink: any watermill publisher. The GoChannel keeps it in-process;
	// subscribe before relaying, it does not keep messages for later.
	sink := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, nil)
	defer sink.Close()
	received, err := sink.Subscribe(ctx, topic)
	if err != nil {
		return err
	}

	run := strings.ToLower(watermill.NewShortUUID()[:8])
	fmt.Println("\n== registering customers")
	committed := map[string]string{} // event id -> customer id
	var refused []string
	for i, email := range []string{"ada@example.com", "bob@example.com", "ada@example.com", "cyd@example.com"} {
		customerID := fmt.Sprintf("cus-%s-%d", run, i+1)
		email = run + "." + email
		eventID, err := registerCustomer(ctx, db, customerID, email)
		// Any driver's error: lib/pq's and pgx's both have SQLState().
		var dbErr interface{ SQLState() string }
		switch {
		case errors.As(err, &dbErr) && dbErr.SQLState() == "23505": // unique_violation
			refused = append(refused, customerID)
			fmt.Printf("register %s %s -> refused (email taken), rolled back: no customer row, no event\n", customerID, email)
		case err != nil:
			return err
		default:
			committed[eventID] = customerID
			fmt.Printf("register %s %s -> committed with event %s\n", customerID, email, eventID)
		}
	}

	relay, err := forwarder.New(db, sink, nil, forwarder.Config{
		PollInterval: 100 * time.Millisecond,
		OnReport: func(r forwarder.Report) {
			if r.Claimed > 0 {
				fmt.Printf("relay    pass: claimed=%d published=%d ambiguous=%d failed=%d exhausted=%d stale=%d\n",
					r.Claimed, r.Published, r.Ambiguous, r.Failed, r.Exhausted, r.Stale)
			}
		},
	})
	if err != nil {
		return err
	}
	fmt.Println("\n== relaying to the sink")
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(context.WithoutCancel(ctx)) }()

	got := map[string]int{}
	ofThisRun := 0
	refusedSeen := 0
wait:
	for ofThisRun < len(committed) {
		select {
		case m := <-received:
			m.Ack()
			var ev CustomerRegistered
			_ = json.Unmarshal(m.Payload, &ev)
			fmt.Printf("sink     <- %s %s customer=%s tenant=%s producer=%s\n", m.Metadata.Get(envelope.KeyMessageType), m.UUID,
				ev.CustomerID, m.Metadata.Get(envelope.KeyTenant), m.Metadata.Get(envelope.KeyProducer))
			for _, id := range refused {
				if ev.CustomerID == id {
					refusedSeen++
				}
			}
			if _, ok := committed[m.UUID]; ok {
				if got[m.UUID]++; got[m.UUID] == 1 {
					ofThisRun++
				}
			}
		case err := <-relayDone:
			return fmt.Errorf("relay stopped: %v", err)
		case <-ctx.Done():
			break wait
		}
	}
	_ = relay.Close()

	// The refused registration must have left no event behind.
	for _, id := range refused {
		var n int
		if err := db.QueryRowContext(context.WithoutCancel(ctx), countEventsOf, id).Scan(&n); err != nil {
			return err
		}
		refusedSeen += n
	}

	fmt.Println("\n== result")
	fmt.Printf("received %d of %d, rolled back %d\n", ofThisRun, len(committed), refusedSeen)
	if ofThisRun != len(committed) || refusedSeen != 0 {
		return errors.New("the sink did not get exactly the committed events")
	}
	return nil
}

// openDatabase connects with search_path set to the URL's schema (or
// defaultSchema), creates it when missing and migrates into it.
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
	db.SetMaxOpenConns(4)
	for _, stmt := range []string{`CREATE SCHEMA IF NOT EXISTS ` + pq.QuoteIdentifier(schema)} {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			_ = db.Close()
			return nil, "", fmt.Errorf("%s (is PostgreSQL running? `make db`): %w", u.Redacted(), err)
		}
	}
	if _, err := migrations.Up(ctx, db); err != nil {
		_ = db.Close()
		return nil, "", err
	}
	if _, err := db.ExecContext(ctx, createCustomers); err != nil {
		_ = db.Close()
		return nil, "", err
	}
	return db, schema, nil
}
