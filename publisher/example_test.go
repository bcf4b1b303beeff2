package publisher_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"log"
	"net/url"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// Publish an event in the same transaction as the business change: both are
// committed together, or neither is.
func ExampleInTx() {
	db, cleanup := exampleDatabase()
	defer cleanup()
	ctx := context.Background()

	msg := message.NewMessage("order-42-paid", []byte(`{"order":42}`))
	envelope.SetMessageType(msg, "OrderPaid")
	envelope.SetPartitionKey(msg, "order-42")

	err := publisher.InTx(ctx, db, publisher.Config{Producer: "billing"},
		func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			if _, err := tx.ExecContext(ctx, `UPDATE orders SET paid = true WHERE id = 42`); err != nil {
				return err
			}
			return pub.Publish("orders.paid", msg)
		})
	if err != nil {
		log.Fatal(err)
	}

	var id, destination, status, producer, routingKey string
	err = db.QueryRowContext(ctx, `SELECT message_id, destination, status, producer, routing_key FROM messaging_outbox`).
		Scan(&id, &destination, &status, &producer, &routingKey)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(id, destination, status, producer, routingKey)
	// Output: order-42-paid orders.paid PENDING billing order-42
}

// exampleDatabase migrates a throwaway schema (chosen through search_path)
// with an orders table, and drops it afterwards.
func exampleDatabase() (*sql.DB, func()) {
	base := cmp.Or(os.Getenv("OUTBOX_TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	schema := "outbox_example_" + hex.EncodeToString(b)
	admin, err := sql.Open("postgres", base)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		log.Fatal(err)
	}
	u, err := url.Parse(base)
	if err != nil {
		log.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	db, err := sql.Open("postgres", u.String())
	if err != nil {
		log.Fatal(err)
	}
	if _, err := migrations.Up(context.Background(), db); err != nil {
		log.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE orders (id int PRIMARY KEY, paid bool NOT NULL DEFAULT false); INSERT INTO orders VALUES (42, false)`); err != nil {
		log.Fatal(err)
	}
	return db, func() {
		_ = db.Close()
		_, _ = admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
		_ = admin.Close()
	}
}
