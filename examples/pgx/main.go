// Command pgx is a service on pgx only: a pgxpool, pgx.Tx transactions, no
// database/sql driver of its own and no lib/pq. placeOrder writes the order
// and its OrderPlaced event in one pgx transaction; the refusals the outbox
// publisher gives on pgx (duplicate id, read-only, aborted and finished
// transactions) are shown with their codes, the same as on lib/pq; and the
// forwarder, which polls only once an hour here, relays each commit because
// the publisher's NOTIFY wakes it through pgxadapter's Listener.
//
// The forwarder and the migrations take a *sql.DB: pgx's own bridge,
// stdlib.OpenDBFromPool, gives one on the same pool.
//
// PostgreSQL comes from OUTBOX_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable); the tables go
// into the URL's search_path schema, or "outbox_demo_pgx" (created if
// missing). It exits non-zero unless every committed order reached the sink,
// no refused one did, and every refusal had its expected code.
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/pgxadapter"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultSchema      = "outbox_demo_pgx"
	topic              = "orders.placed"
)

// pubConfig publishes with NOTIFY, so the forwarder wakes at each commit.
var pubConfig = publisher.Config{Producer: "pgx-shop", Notify: true}

// placeOrder is the function to copy: the order row and its event commit in
// one pgx transaction or not at all.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, orderID string, msg *message.Message) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO pgx_orders (id) VALUES ($1)`, orderID); err != nil {
			return err
		}
		pub, err := pgxadapter.NewPublisher(tx, pubConfig, nil)
		if err != nil {
			return err
		}
		defer pub.Close()
		return pub.Publish(topic, msg)
	})
}

func newEvent(orderID string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"`+orderID+`"}`))
	envelope.SetMessageType(msg, "OrderPlaced")
	envelope.SetAggregate(msg, "order", orderID, 1)
	return msg
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	if err := run(ctx, cmp.Or(os.Getenv("OUTBOX_DATABASE_URL"), defaultDatabaseURL)); err != nil {
		fmt.Fprintln(os.Stderr, "pgx failed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dbURL string) error {
	pool, poolURL, schema, err := openPool(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool) // database/sql on the same pgx pool
	defer db.Close()
	if _, err := migrations.Up(ctx, db); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS pgx_orders (id text PRIMARY KEY)`); err != nil {
		return err
	}
	fmt.Printf("== database schema %s (migrated, pgx only)\n", schema)

	sink := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, nil)
	defer sink.Close()
	received, err := sink.Subscribe(ctx, topic)
	if err != nil {
		return err
	}

	// The forwarder polls once an hour: what it relays below, it relays
	// because a NOTIFY (or the listener's first connection) woke it.
	listener, err := pgxadapter.NewListener(poolURL)
	if err != nil {
		return err
	}
	passes := make(chan struct{}, 1)
	relay, err := forwarder.New(db, sink, nil, forwarder.Config{
		Listener: listener, PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(r forwarder.Report) {
			select {
			case passes <- struct{}{}:
			default:
			}
			if r.Claimed > 0 {
				fmt.Printf("relay    woke and relayed: claimed=%d published=%d\n", r.Claimed, r.Published)
			}
		},
	})
	if err != nil {
		return err
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(context.WithoutCancel(ctx)) }()
	defer func() { _ = relay.Close() }()
	<-passes // the relay's first pass found nothing; the next poll is an hour away

	run := strings.ToLower(watermill.NewShortUUID()[:8])
	fmt.Println("\n== placing orders (pgx.Tx)")
	committed := map[string]bool{}
	var first *message.Message
	for i := range 3 {
		orderID := fmt.Sprintf("ord-%s-%d", run, i+1)
		msg := newEvent(orderID)
		if err := placeOrder(ctx, pool, orderID, msg); err != nil {
			return err
		}
		if first == nil {
			first = msg
		}
		committed[msg.UUID] = true
		fmt.Printf("order %s -> committed with event %s\n", orderID, msg.UUID)
	}

	fmt.Println("\n== refusals on pgx, with the codes lib/pq gives")
	refusedIDs, err := showRefusals(ctx, pool, run, first.UUID)
	if err != nil {
		return err
	}

	got := map[string]int{}
	refusedSeen := 0
	for len(got) < len(committed) {
		select {
		case m := <-received:
			m.Ack()
			fmt.Printf("sink     <- %s %s\n", m.Metadata.Get(envelope.KeyMessageType), m.UUID)
			if committed[m.UUID] {
				got[m.UUID]++
			}
			if refusedIDs[m.UUID] {
				refusedSeen++
			}
		case err := <-relayDone:
			return fmt.Errorf("relay stopped: %v", err)
		case <-ctx.Done():
			return fmt.Errorf("only %d of %d events relayed: the forwarder was not woken", len(got), len(committed))
		}
	}
	if err := relay.Close(); err != nil { // its reports print before the result
		return err
	}
	for id := range refusedIDs {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM messaging_outbox WHERE message_id = $1`, id).Scan(&n); err != nil {
			return err
		}
		refusedSeen += n
	}
	fmt.Println("\n== result")
	fmt.Printf("received %d of %d, rolled back %d\n", len(got), len(committed), refusedSeen)
	if refusedSeen != 0 {
		return errors.New("a refused event was written or relayed")
	}
	return nil
}

// showRefusals runs each refusal in its own pgx transaction, checks its
// code, and returns the ids of the events that must never be relayed.
func showRefusals(ctx context.Context, pool *pgxpool.Pool, run, takenID string) (map[string]bool, error) {
	ids := map[string]bool{}
	expect := func(what string, err error, want outbox.Code) error {
		if got := outbox.CodeOf(err); got != want {
			return fmt.Errorf("%s: got code %q (%v), want %s", what, got, err, want)
		}
		fmt.Printf("%-28s -> refused: %s\n", what, want)
		return nil
	}
	attempt := func(opts pgx.TxOptions, before func(pgx.Tx) error, msg *message.Message, after func(pgx.Tx, *publisher.Publisher) error) error {
		tx, err := pool.BeginTx(ctx, opts)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if before != nil {
			if err := before(tx); err != nil {
				return err
			}
		}
		pub, err := pgxadapter.NewPublisher(tx, pubConfig, nil)
		if err != nil {
			return err
		}
		if after != nil {
			return after(tx, pub)
		}
		ids[msg.UUID] = true
		return pub.Publish(topic, msg)
	}

	// 1. An id already in the outbox (the first order's event).
	dup := newEvent("ord-" + run + "-dup")
	dup.UUID = takenID
	if err := expect("duplicate message id", attempt(pgx.TxOptions{}, nil, dup, nil), outbox.CodeDuplicateMessageID); err != nil {
		return nil, err
	}
	// 2. A read-only transaction (SQLSTATE 25006).
	if err := expect("read-only transaction", attempt(pgx.TxOptions{AccessMode: pgx.ReadOnly}, nil, newEvent("ord-"+run+"-ro"), nil), outbox.CodeTransactionRequired); err != nil {
		return nil, err
	}
	// 3. A transaction an earlier statement aborted (25P02).
	failed := func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT 1/0`)
		if err == nil {
			return errors.New("SELECT 1/0 succeeded")
		}
		return nil
	}
	if err := expect("aborted transaction", attempt(pgx.TxOptions{}, failed, newEvent("ord-"+run+"-aborted"), nil), outbox.CodeTransactionRequired); err != nil {
		return nil, err
	}
	// 4. Outside a transaction: publishing after the commit.
	late := newEvent("ord-" + run + "-late")
	ids[late.UUID] = true
	afterCommit := func(tx pgx.Tx, pub *publisher.Publisher) error {
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		return pub.Publish(topic, late)
	}
	if err := expect("outside a transaction", attempt(pgx.TxOptions{}, nil, late, afterCommit), outbox.CodeTransactionRequired); err != nil {
		return nil, err
	}
	delete(ids, takenID) // the taken id is the first order's, relayed once
	return ids, nil
}

// openPool connects a pgxpool with search_path set to the URL's schema (or
// defaultSchema), creating it when missing. It returns the pool's URL.
func openPool(ctx context.Context, rawURL string) (*pgxpool.Pool, string, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, "", "", errors.New("OUTBOX_DATABASE_URL must be a postgres:// URL")
	}
	q := u.Query()
	schema := strings.Trim(strings.TrimSpace(strings.Split(q.Get("search_path"), ",")[0]), `"`)
	if schema == "" {
		schema = defaultSchema
		q.Set("search_path", schema)
	}
	q.Set("pool_max_conns", "4")
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		return nil, "", "", err
	}
	if _, err := pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{schema}.Sanitize()); err != nil {
		pool.Close()
		return nil, "", "", fmt.Errorf("%s (is PostgreSQL running? `make db`): %w", u.Redacted(), err)
	}
	return pool, u.String(), schema, nil
}
