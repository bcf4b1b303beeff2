package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Sustained rounds (group "sustained", opt-in: -only sustained): does a
// relay keep its drain rate over consecutive fill-and-drain rounds in one
// schema, as the dead row versions of the earlier rounds pile up, and with
// a REPEATABLE READ transaction holding a snapshot open across all of them
// (nothing dead since it started can be vacuumed or pruned)?
//
// For each relay and mode, one fresh schema: SustainedRounds rounds, each a
// fill of SustainedRows unkeyed rows (new ids), a CHECKPOINT (settle, as
// before every drain cell), then the relay started, the rows drained into a
// GoChannel and every row's terminal write committed, the relay stopped.
// The rate of a round is from its relay's start to its last message.
// Vacuum is whatever the server's autovacuum does (the run records
// `SHOW autovacuum` in the targets' notes: it may be off on a test server,
// and the benchmark does not change the server's settings).
//
// With "snapshot", a transaction on its own connection runs `SELECT 1 FROM
// messaging_outbox LIMIT 1` at REPEATABLE READ before the first fill and
// stays open until the last round ended.

// sustainedKinds are the relays of the sustained rounds: per-row leases,
// lanes, and the minimal relay at batch 1000 (its faster batch in every
// recorded drain).
var sustainedKinds = []string{relayOurs, relayOursLanes, relayMinimalTuned}

const (
	modeSnapshot   = "snapshot"
	modeNoSnapshot = "nosnapshot"
)

func sustainedName(kind, mode string, round int) string {
	return fmt.Sprintf("sustained/%s/%s/r%d", kind, mode, round)
}

// sustainedModes are the modes in run order for repetition rep (swapped
// every other repetition).
func sustainedModes(rep int) []string {
	if rep%2 == 0 {
		return []string{modeSnapshot, modeNoSnapshot}
	}
	return []string{modeNoSnapshot, modeSnapshot}
}

func runSustained(ctx context.Context, e *env, cfg Config, c *collector, rep int, payload []byte, timeout time.Duration, logf func(string, ...any)) error {
	for _, mode := range sustainedModes(rep) {
		for _, k := range sustainedKinds {
			start := time.Now()
			rates, err := sustainedCell(ctx, e, k, cfg.SustainedRows, cfg.SustainedRounds, mode == modeSnapshot, payload, timeout)
			if err != nil {
				return fmt.Errorf("sustained %s %s: %w", k, mode, err)
			}
			c.add("sustained", sustainedName(k, mode, 1), "msg/s", rates[0])
			c.add("sustained", sustainedName(k, mode, len(rates)), "msg/s", rates[len(rates)-1])
			logf("  %-28s rounds %v msg/s, last/first %.2f (%s)", "sustained/"+k+"/"+mode, roundRates(rates),
				ratio(rates[len(rates)-1], rates[0]), time.Since(start).Round(time.Second))
		}
	}
	return nil
}

func roundRates(r []float64) []int {
	out := make([]int, len(r))
	for i, v := range r {
		out[i] = int(v)
	}
	return out
}

// sustainedCell runs the rounds of one relay and mode in one schema and
// returns each round's drain rate.
func sustainedCell(ctx context.Context, e *env, kind string, rows, rounds int, snapshot bool, payload []byte, timeout time.Duration) ([]float64, error) {
	s, err := e.newSchema(ctx, 2)
	if err != nil {
		return nil, err
	}
	defer s.drop()
	if kind == relayOursLanes {
		if err := fencing.SetLaneCount(ctx, s.db, 32, forwarder.DefaultMaxAttempts); err != nil {
			return nil, err
		}
	}
	if snapshot {
		holder, err := s.open(1)
		if err != nil {
			return nil, err
		}
		defer holder.Close()
		tx, err := holder.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		if err != nil {
			return nil, err
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.ExecContext(ctx, `SELECT 1 FROM messaging_outbox LIMIT 1`); err != nil {
			return nil, fmt.Errorf("snapshot: %w", err)
		}
	}
	rates := make([]float64, 0, rounds)
	for round := 1; round <= rounds; round++ {
		if err := prefill(ctx, s.db, prefillOutbox, fmt.Sprintf("r%d-", round), rows, payload); err != nil {
			return nil, err
		}
		rate, err := sustainedRound(ctx, s, kind, rows, round*rows, timeout)
		if err != nil {
			return nil, fmt.Errorf("round %d: %w", round, err)
		}
		rates = append(rates, rate)
	}
	return rates, nil
}

// sustainedRound drains the round's rows rows with one relay of kind and
// waits until published rows of the schema (all rounds') reach published.
func sustainedRound(ctx context.Context, s *schema, kind string, rows, published int, timeout time.Duration) (float64, error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	snk, err := newSink(sctx, rows)
	if err != nil {
		return 0, err
	}
	defer snk.close()
	settle(ctx, s.db)
	start := time.Now()
	r, err := startRelay(sctx, s, kind, 1, snk.ch, false)
	if err != nil {
		return 0, err
	}
	defer r.stop()
	select {
	case <-snk.done:
	case err := <-r.failed:
		return 0, fmt.Errorf("a relay ended with %d of %d messages arrived: %w", snk.count.Load(), rows, err)
	case <-time.After(timeout):
		return 0, fmt.Errorf("only %d of %d messages arrived within %s", snk.count.Load(), rows, timeout)
	}
	rate := float64(rows) / time.Since(start).Seconds()
	if err := waitPublished(ctx, s, published); err != nil {
		return 0, err
	}
	r.stop()
	return rate, nil
}

// sustainedTargets: the last round's rate >= 0.8x the first's, per relay
// and mode (only in a run of the opt-in group).
func sustainedTargets(cfg Config, c *collector, add func(name string, r, need float64, note string)) {
	if !cfg.runs("sustained") {
		return
	}
	for _, mode := range []string{modeNoSnapshot, modeSnapshot} {
		for _, k := range sustainedKinds {
			first, last := sustainedName(k, mode, 1), sustainedName(k, mode, cfg.SustainedRounds)
			note := fmt.Sprintf("%d fill-and-drain rounds of %d rows in one schema, one relay; last round's rate / first's within each repetition (median)", cfg.SustainedRounds, cfg.SustainedRows)
			if _, ok := c.by[last]; !ok {
				note = "not measured in this run (" + last + " missing)"
			}
			add(fmt.Sprintf("sustained: %s %s, round %d / round 1", k, mode, cfg.SustainedRounds), c.pairRatio(last, first), 0.8, note)
		}
	}
}
