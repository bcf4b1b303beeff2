package forwarder_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// Commit a message with the business change, then let the relay move it to
// the broker (here watermill's in-memory GoChannel).
func Example() {
	db, cleanup := exampleDatabase()
	defer cleanup()
	ctx := context.Background()

	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, watermill.NopLogger{})
	defer broker.Close()
	received, err := broker.Subscribe(ctx, "orders.paid")
	if err != nil {
		log.Fatal(err)
	}

	err = publisher.InTx(ctx, db, publisher.Config{Producer: "billing"},
		func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			msg := message.NewMessage("order-42-paid", []byte(`{"order":42}`))
			envelope.SetMessageType(msg, "OrderPaid")
			return pub.Publish("orders.paid", msg)
		})
	if err != nil {
		log.Fatal(err)
	}

	relay, err := forwarder.New(db, broker, nil, forwarder.Config{Owner: "relay-example"})
	if err != nil {
		log.Fatal(err)
	}
	defer relay.Close()
	report, err := relay.RunOnce(ctx) // Run(ctx) loops; one pass is enough here
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("claimed=%d published=%d ambiguous=%d stale=%d\n", report.Claimed, report.Published, report.Ambiguous, report.Stale)

	got := <-received
	got.Ack()
	fmt.Println(got.UUID, string(got.Payload), got.Metadata.Get(envelope.KeyMessageType), got.Metadata.Get(envelope.KeyProducer))

	var status string
	if err := db.QueryRow(`SELECT status FROM messaging_outbox WHERE message_id = 'order-42-paid'`).Scan(&status); err != nil {
		log.Fatal(err)
	}
	fmt.Println(status)
	// Output:
	// claimed=1 published=1 ambiguous=0 stale=0
	// order-42-paid {"order":42} OrderPaid billing
	// PUBLISHED
}

// Run the relay with an existing watermill router: it starts with the
// router and is drained when the router closes.
func ExampleForwarder_RouterPlugin() {
	db, cleanup := exampleDatabase()
	defer cleanup()

	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, watermill.NopLogger{})
	defer broker.Close()
	received, err := broker.Subscribe(context.Background(), "orders.paid")
	if err != nil {
		log.Fatal(err)
	}
	relay, err := forwarder.New(db, broker, nil, forwarder.Config{})
	if err != nil {
		log.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	router.AddPlugin(relay.RouterPlugin())
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-relay.Running()

	err = publisher.InTx(context.Background(), db, publisher.Config{Notify: true},
		func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			return pub.Publish("orders.paid", message.NewMessage("order-7-paid", []byte(`{"order":7}`)))
		})
	if err != nil {
		log.Fatal(err)
	}
	got := <-received
	got.Ack()
	fmt.Println("received", got.UUID)

	if err := router.Close(); err != nil {
		log.Fatal(err)
	}
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	fmt.Println("router and relay stopped")
	// Output:
	// received order-7-paid
	// router and relay stopped
}

// exampleDatabase migrates a throwaway schema and drops it afterwards.
func exampleDatabase() (*sql.DB, func()) {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	schema := "outbox_example_" + hex.EncodeToString(b)
	admin, err := sql.Open("postgres", testdb.URL())
	if err != nil {
		log.Fatal(err)
	}
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		log.Fatal(err)
	}
	db, err := sql.Open("postgres", testdb.WithSearchPath(testdb.URL(), schema))
	if err != nil {
		log.Fatal(err)
	}
	db.SetMaxOpenConns(4)
	if _, err := migrations.Up(context.Background(), db); err != nil {
		log.Fatal(err)
	}
	return db, func() {
		_ = db.Close()
		_, _ = admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
		_ = admin.Close()
	}
}
