// Command relayproc is the relay process the chaos soak (package
// internal/chaos) starts, kills, pauses and restarts. It runs one forwarder
// against the outbox (through the soak's fault proxy) and publishes to a
// downstream that records every delivery durably in the soak's tables over
// its own direct connection, and that injects downstream faults: errors
// before accepting, timeouts after accepting (ambiguous), permanent
// rejections, and hangs past the publish timeout.
//
// It is a test tool, not a product: the product's relay is `outboxctl relay`.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Statements on the soak's own tables (created by the soak test).
const (
	insertDelivery = `INSERT INTO chaos_delivery (message_id, logical_id, ordering_key, owner, lease_token, outcome)
VALUES ($1, $2, nullif($3, ''), $4, $5, $6)`
	insertStale    = `INSERT INTO chaos_stale (owner, message_id, lease_token) VALUES ($1, $2, $3)`
	insertReport   = `INSERT INTO chaos_report (owner, stale, failed_pass, unrecorded, claim_failures, claim_released) VALUES ($1, $2, $3, $4, $5, $6)`
	insertUnwrit   = `INSERT INTO chaos_unwritten (owner, message_id, lease_token) VALUES ($1, $2, $3)`
	insertFault    = `INSERT INTO chaos_fault (owner, kind) VALUES ($1, $2)`
	rejectedCode   = "CHAOS_REJECTED"
	fateHeader     = "chaos-fate"
	fateReject     = "reject"
	outageError    = "chaos outage: broker unavailable"
	outcomeOK      = "confirmed"
	outcomeAmbig   = "accepted-then-timeout"
	outcomeLate    = "accepted-after-hang"
	hangFor        = 1200 * time.Millisecond
	recordDeadline = 10 * time.Second
)

func main() {
	// First, before anything can be claimed: a SIGTERM that arrives while the
	// process starts must drain like any other, not kill it. (The soak treats
	// a relay killed by SIGTERM as one that never got here, so held nothing.)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	dsn := flag.String("dsn", "", "outbox database (through the fault proxy)")
	sinkDSN := flag.String("sink-dsn", "", "database for the delivery log (direct)")
	owner := flag.String("owner", "", "lease owner")
	seed := flag.Uint64("seed", 1, "fault seed")
	pErr := flag.Float64("p-error", 0.04, "probability of an error before accepting")
	pAmbig := flag.Float64("p-ambiguous", 0.05, "probability of a timeout after accepting")
	pHang := flag.Float64("p-hang", 0.02, "probability of a hang past the publish timeout")
	noPrefetch := flag.Bool("no-prefetch", false, "DisablePrefetch: claim without pipelining")
	flag.Parse()
	if err := run(ctx, *dsn, *sinkDSN, *owner, *seed, *pErr, *pAmbig, *pHang, *noPrefetch); err != nil {
		fmt.Fprintln(os.Stderr, "relayproc:", err)
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn, sinkDSN, owner string, seed uint64, pErr, pAmbig, pHang float64, noPrefetch bool) error {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(4)
	sinkDB, err := sql.Open("postgres", sinkDSN)
	if err != nil {
		return err
	}
	defer sinkDB.Close()
	sinkDB.SetMaxOpenConns(3)

	ds := &downstream{db: sinkDB, owner: owner, rng: rand.New(rand.NewPCG(seed, seed^0x5eed)),
		pErr: pErr, pAmbig: pAmbig, pHang: pHang}
	logger := &evidenceLogger{LoggerAdapter: watermill.NewStdLogger(false, false), ds: ds}
	fwd, err := forwarder.New(db, ds, logger, forwarder.Config{
		Owner:             owner,
		BatchSize:         20,
		Concurrency:       4,
		LeaseDuration:     2 * time.Second,
		PublishTimeout:    500 * time.Millisecond,
		PollInterval:      50 * time.Millisecond,
		MaxPollInterval:   300 * time.Millisecond,
		BackoffBase:       100 * time.Millisecond,
		BackoffMax:        time.Second,
		MaxAttempts:       25,
		HeartbeatInterval: time.Second,
		BreakerProbeMax:   2 * time.Second,
		DisablePrefetch:   noPrefetch,
		TracerProvider:    sdktrace.NewTracerProvider(),
		OnReport: func(r forwarder.Report) {
			if r.Stale > 0 || r.UnrecordedPublishes > 0 || r.ClaimFailures > 0 {
				ds.exec(insertReport, owner, r.Stale, false, r.UnrecordedPublishes, r.ClaimFailures, r.ClaimReleased)
			}
		},
	})
	if err != nil {
		return err
	}
	return fwd.Run(ctx)
}

// downstream records deliveries and injects faults. The lease token of the
// attempt comes from the forwarder's publish span (attribute
// outbox.lease_token), read through the SDK's ReadOnlySpan.
type downstream struct {
	db                  *sql.DB
	owner               string
	mu                  sync.Mutex
	rng                 *rand.Rand
	pErr, pAmbig, pHang float64

	omu     sync.Mutex
	down    bool      // the outage is on
	checked time.Time // when chaos_outage was last read
}

func (d *downstream) roll() float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rng.Float64()
}

func (d *downstream) exec(q string, args ...any) {
	ctx, cancel := context.WithTimeout(context.Background(), recordDeadline)
	defer cancel()
	if _, err := d.db.ExecContext(ctx, q, args...); err != nil {
		// The evidence is the point of this process: without it the soak
		// cannot judge, so stop loudly.
		fmt.Fprintln(os.Stderr, "relayproc: cannot record evidence:", err)
		os.Exit(3)
	}
}

func (d *downstream) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := d.publishOne(m); err != nil {
			return err
		}
	}
	return nil
}

// outage reports whether the soak's broker outage is on (chaos_outage), asking
// the database at most every 50 ms.
func (d *downstream) outage() bool {
	d.omu.Lock()
	defer d.omu.Unlock()
	if time.Since(d.checked) < 50*time.Millisecond {
		return d.down
	}
	var left float64
	if err := d.db.QueryRow(`SELECT coalesce(extract(epoch FROM until - clock_timestamp()), 0) FROM chaos_outage`).Scan(&left); err == nil {
		d.down, d.checked = left > 0, time.Now()
	}
	return d.down
}

func (d *downstream) publishOne(m *message.Message) error {
	if d.outage() {
		// The broker is gone for everyone: what a client says when it cannot
		// connect (a plain error: the default classifier and the breaker
		// must tell it from a message's own failure).
		return errors.New(outageError)
	}
	if m.Metadata.Get(fateHeader) == fateReject {
		d.exec(insertFault, d.owner, "downstream-reject")
		return forwarder.Reject(errors.New("downstream refuses this message for good"), rejectedCode)
	}
	token := leaseToken(m)
	r := d.roll()
	switch {
	case r < d.pErr:
		d.exec(insertFault, d.owner, "downstream-error")
		return errors.New("broker unavailable (nothing accepted)")
	case r < d.pErr+d.pHang:
		d.exec(insertFault, d.owner, "downstream-hang")
		// Hang past the publish timeout; half of the hangs accept late.
		t := time.NewTimer(hangFor)
		<-t.C
		if d.roll() < 0.5 {
			d.record(m, token, outcomeLate)
		}
		return errors.New("hung")
	}
	if r < d.pErr+d.pHang+d.pAmbig {
		d.record(m, token, outcomeAmbig)
		d.exec(insertFault, d.owner, "downstream-ambiguous")
		return errors.New("timeout waiting for the broker's confirm (it may have the message)")
	}
	d.record(m, token, outcomeOK)
	return nil
}

func (d *downstream) record(m *message.Message, token int64, outcome string) {
	var body struct {
		ID string `json:"id"`
	}
	_ = json.Unmarshal(m.Payload, &body)
	d.exec(insertDelivery, m.UUID, body.ID, m.Metadata.Get(envelope.KeyOrderingKey), d.owner, token, outcome)
}

// unwritten records the rows of an outcome statement that failed: their
// confirmed deliveries may not have been written PUBLISHED under their own
// lease, and the forwarder said so (it logs their ids and lease tokens).
func (d *downstream) unwritten(ids []string, tokens []int64) {
	for i, id := range ids {
		d.exec(insertUnwrit, d.owner, id, tokens[i])
	}
	d.exec(insertReport, d.owner, 0, true, 0, 0, 0)
}

func (d *downstream) Close() error { return nil }

func leaseToken(m *message.Message) int64 {
	ro, ok := trace.SpanFromContext(m.Context()).(sdktrace.ReadOnlySpan)
	if !ok {
		return -1
	}
	for _, kv := range ro.Attributes() {
		if kv.Key == attribute.Key("outbox.lease_token") {
			return kv.Value.AsInt64()
		}
	}
	return -1
}

// evidenceLogger records what the forwarder says about stale writes and
// failed passes in the soak's tables, and logs everything to stderr.
type evidenceLogger struct {
	watermill.LoggerAdapter
	ds *downstream
}

func (l *evidenceLogger) Warn(msg string, fields watermill.LogFields) {
	if id, ok := fields["message_id"].(string); ok {
		tok, _ := fields["lease_token"].(int64)
		l.ds.exec(insertStale, l.ds.owner, id, tok)
	}
	l.LoggerAdapter.Info(msg, fields.Add(watermill.LogFields{"severity": "warn"}))
}

func (l *evidenceLogger) Error(msg string, err error, fields watermill.LogFields) {
	ids, _ := fields["message_ids"].([]string)
	tokens, _ := fields["lease_tokens"].([]int64)
	if len(ids) > 0 && len(ids) == len(tokens) {
		l.ds.unwritten(ids, tokens)
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l *evidenceLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &evidenceLogger{LoggerAdapter: l.LoggerAdapter.With(fields), ds: l.ds}
}
