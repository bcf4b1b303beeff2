package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// relayOneCommit is a what-if prototype, not the product: the fenced relay
// with the terminal write of batch N and the claim of batch N+1 in ONE
// transaction (fencing.Apply then fencing.Claim on the same *sql.Tx), so a
// batch costs one commit and one fewer round trip instead of two commits.
// It measures the fix proposed in BENCHMARKS.md for the forwarder's pass;
// it keeps leases, tokens and the fenced write, and skips what the real
// forwarder adds (publish timeout, classification, retries, metrics).
const relayOneCommit = "prototype-1commit"

func runOneCommit(ctx context.Context, db *sql.DB, out message.Publisher) error {
	owner := "bench-1commit-" + suffix()
	var pending []fencing.Outcome
	for {
		claimed, err := applyAndClaim(context.WithoutCancel(ctx), db, pending, owner, ctx.Err() != nil)
		if err != nil {
			return err
		}
		pending = nil
		if ctx.Err() != nil {
			return nil
		}
		if len(claimed) == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		byTopic := map[string][]*message.Message{}
		for _, c := range claimed {
			if !c.Held() {
				continue
			}
			msg, err := envelope.ToMessage(c.Row, envelope.Options{})
			if err != nil {
				return err
			}
			byTopic[c.Row.Destination] = append(byTopic[c.Row.Destination], msg)
			pending = append(pending, fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished})
		}
		for topic, msgs := range byTopic {
			if err := out.Publish(topic, msgs...); err != nil {
				return err
			}
		}
	}
}

// applyAndClaim writes the previous batch's outcomes and claims the next
// batch in one transaction (only writes when stopping).
func applyAndClaim(ctx context.Context, db *sql.DB, outcomes []fencing.Outcome, owner string, stopping bool) ([]fencing.Claimed, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }()
	if len(outcomes) > 0 {
		if _, err := fencing.Apply(ctx, tx, outcomes); err != nil {
			return nil, fmt.Errorf("apply: %w", err)
		}
	}
	var claimed []fencing.Claimed
	if !stopping {
		p := probeParams()
		p.Owner = owner
		if claimed, err = fencing.Claim(ctx, tx, p); err != nil {
			return nil, fmt.Errorf("claim: %w", err)
		}
	}
	return claimed, tx.Commit()
}
