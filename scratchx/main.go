package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	_ "github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

func main() {
	db, err := sql.Open("postgres", "postgres://postgres@127.0.0.1:5432/perf?sslmode=disable")
	if err != nil {
		panic(err)
	}
	db.SetMaxOpenConns(1)
	ctx := context.Background()
	p := fencing.ClaimParams{Owner: "o", Limit: 100, Lease: time.Minute, MaxAttempts: 25, Policy: fencing.BlockKey, MaxChain: 13, NoKeyWalk: true, MaxBytes: 8 << 20}
	rows, _ := db.Query(`SELECT ordering_key, seq, message_id FROM messaging_outbox WHERE seq <= 100`)
	for rows.Next() {
		var c fencing.Continuation
		rows.Scan(&c.Key, &c.AfterSeq, &c.AfterID)
		p.Continue = append(p.Continue, c)
	}
	rows.Close()
	q, args, err := fencing.ClaimStatement(p)
	if err != nil {
		panic(err)
	}
	st, err := db.Prepare(q)
	if err != nil {
		panic(err)
	}
	for i := 0; i < 12; i++ {
		tx, _ := db.BeginTx(ctx, nil)
		t0 := time.Now()
		r, err := tx.Stmt(st).QueryContext(ctx, args...)
		if err != nil {
			panic(err)
		}
		var lines []string
		for r.Next() {
			var s string
			r.Scan(&s)
			lines = append(lines, s)
		}
		r.Close()
		tx.Rollback()
		_ = lines
		fmt.Println("took", time.Since(t0))
	}
	var g, c int
	db.QueryRow(`SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%WITH RECURSIVE walk%'`).Scan(&g, &c)
	fmt.Println("generic", g, "custom", c, strings.Repeat("", 0))
}
