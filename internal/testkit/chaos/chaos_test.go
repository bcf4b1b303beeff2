package chaos_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// The soak runs on two databases. The outbox side (messaging_outbox, the
// business table, the park log) lives on a throwaway cluster the test
// starts (testdb.Throwaway), so that the cluster can be restarted; the
// evidence side (the downstream's delivery log, the relays' reports, the
// consumer's inbox and effects) lives on the shared server, which is never
// restarted: a PostgreSQL restart hits the outbox database only, as it
// would in production, where the broker and its consumers are elsewhere.
// Without initdb/pg_ctl both sides are schemas on the shared server and the
// restart fault alone is skipped (loudly).

// The evidence tables. chaos_delivery is the downstream's durable log: one
// row per accepted delivery, written by the relay process over its own
// direct connection before Publish returns; its identity column orders
// deliveries in real time across processes (a row is inserted only after
// the previous delivery of the same key committed).
const createEvidence = `
CREATE TABLE chaos_delivery (
    delivery_id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   text NOT NULL,
    logical_id   text NOT NULL,
    ordering_key text,
    owner        text NOT NULL,
    lease_token  bigint NOT NULL,
    outcome      text NOT NULL,
    at           timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE chaos_stale (owner text NOT NULL, message_id text NOT NULL, lease_token bigint NOT NULL);
CREATE TABLE chaos_unwritten (owner text NOT NULL, message_id text NOT NULL, lease_token bigint NOT NULL);
CREATE TABLE chaos_report (owner text NOT NULL, stale int NOT NULL, failed_pass boolean NOT NULL,
    unrecorded int NOT NULL, claim_failures int NOT NULL, claim_released int NOT NULL);
CREATE TABLE chaos_fault (owner text NOT NULL, kind text NOT NULL, message_id text,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE chaos_outage (until timestamptz);
INSERT INTO chaos_outage VALUES (NULL);
CREATE TABLE chaos_hang (until timestamptz);
INSERT INTO chaos_hang VALUES (NULL);
CREATE TABLE chaos_hung (owner text NOT NULL, message_id text NOT NULL, lease_token bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE chaos_healed (message_id text PRIMARY KEY);
CREATE TABLE chaos_gauge (owner text PRIMARY KEY, max_goroutines int NOT NULL, max_abandoned int NOT NULL,
    paused_passes int NOT NULL, claimed_while_paused int NOT NULL);
CREATE TABLE chaos_effect (message_id text NOT NULL, worker int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE chaos_ack (delivery_id bigint PRIMARY KEY);
CREATE TABLE chaos_attempt (owner text NOT NULL, message_id text NOT NULL, lease_token bigint NOT NULL,
    ok boolean NOT NULL, code text NOT NULL);`

// The outbox side: the business table, and the park log, a trigger that
// records each time a row becomes parked (parked_at set), with the time:
// the per-key order check under SkipParked and the redrive check read it.
const createOutboxSide = `
CREATE TABLE chaos_business (tx_id text PRIMARY KEY);
CREATE TABLE chaos_parklog (message_id text NOT NULL, status text NOT NULL, code text,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION chaos_parklog_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO %[1]s.chaos_parklog (message_id, status, code) VALUES (NEW.message_id, NEW.status, NEW.last_failure_code);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_parklog AFTER UPDATE ON messaging_outbox FOR EACH ROW
    WHEN (OLD.parked_at IS NULL AND NEW.parked_at IS NOT NULL) EXECUTE FUNCTION chaos_parklog_fn();`

const (
	insertBusiness = `INSERT INTO chaos_business (tx_id) VALUES ($1)`
	// unsettled: rows that are neither terminal nor, under BlockKey, held
	// back by a parked earlier row of their ordering key.
	countUnsettledBlock = `
SELECT count(*) FROM messaging_outbox o
 WHERE o.status NOT IN ('PUBLISHED', 'FAILED', 'EXHAUSTED')
   AND NOT EXISTS (SELECT 1 FROM messaging_outbox e
                    WHERE e.ordering_key = o.ordering_key AND e.seq < o.seq
                      AND e.status IN ('FAILED', 'EXHAUSTED'))`
	countUnsettledSkip = `SELECT count(*) FROM messaging_outbox WHERE status NOT IN ('PUBLISHED', 'FAILED', 'EXHAUSTED')`
	terminateRelays    = `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`
	leaseForSoak       = 2 * time.Second // relayproc's LeaseDuration
	// relayproc's Concurrency, and the MaxAbandoned the soak gives it.
	relayConcurrency  = 4
	relayMaxAbandoned = 8
)

type soakConfig struct {
	relays, producers, messages, keys int
	poison                            int // rows written by SQL that no relay can turn into a message
	window                            time.Duration
	budget                            map[string]int // faults injected at random by the test, per kind
	restarts                          int            // PostgreSQL restarts, at seeded times in the window
	hangFrom, hangFor                 time.Duration  // the window of the downstream that hangs forever
	hangTerms                         int            // relays sent SIGTERM while their publishes hang
	opEvery                           time.Duration  // the operator's redrive/purge cadence
	opRows                            int            // rows per redrive or purge
	settle                            time.Duration
}

func configFromEnv() (soakConfig, string) {
	if os.Getenv("OUTBOX_SOAK") == "long" {
		return soakConfig{relays: 4, producers: 3, messages: 4500, keys: 400, window: 3 * time.Minute, poison: 45,
			budget:   map[string]int{"sigkill": 30, "sigstop": 15, "conn-cut": 15, "conn-latency": 15, "pg-terminate": 15},
			restarts: 3, hangFrom: 20 * time.Second, hangFor: 30 * time.Second, hangTerms: 2,
			opEvery: 12 * time.Second, opRows: 12, settle: 5 * time.Minute}, "long"
	}
	return soakConfig{relays: 3, producers: 2, messages: 500, keys: 150, window: 25 * time.Second, poison: 8,
		budget:   map[string]int{"sigkill": 4, "sigstop": 2, "conn-cut": 2, "conn-latency": 2, "pg-terminate": 2},
		restarts: 1, hangFrom: 2 * time.Second, hangFor: 6 * time.Second, hangTerms: 1,
		opEvery: 4 * time.Second, opRows: 5, settle: 90 * time.Second}, "short"
}

// TestChaosSoak runs the soak once, under the ordering policy the seed
// picks (OUTBOX_SOAK_ORDERING=block|skip pins it); the long form runs it
// twice, once per policy: a fleet never mixes policies over the same keys
// (not a supported setup).
func TestChaosSoak(t *testing.T) {
	cfg, form := configFromEnv()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("OUTBOX_SOAK_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "OUTBOX_SOAK_SEED")
		seed = n
	}
	fmt.Printf("chaos soak (%s): seed %d (replay the fault schedule with OUTBOX_SOAK_SEED=%d)\n", form, seed, seed)
	policies := []fencing.OrderingPolicy{fencing.BlockKey, fencing.SkipParked}
	switch os.Getenv("OUTBOX_SOAK_ORDERING") {
	case "block":
		policies = policies[:1]
	case "skip":
		policies = policies[1:]
	case "":
		if form == "short" {
			policies = policies[seed%2 : seed%2+1]
		}
	default:
		t.Fatalf("OUTBOX_SOAK_ORDERING must be block or skip")
	}
	lanes := soakOnLanes(t, form, seed)
	fmt.Printf("chaos soak: relays on %s\n", map[bool]string{false: "per-row leases", true: "lanes"}[lanes])
	for _, p := range policies {
		t.Run(p.String(), func(t *testing.T) { runSoak(t, cfg, form, seed, p, lanes) })
	}
}

// soakOnLanes reports whether the soak's relays run on lanes
// (OUTBOX_SOAK_FENCE=lanes) or on per-row leases (rows). Unset, the short
// form picks one from the seed, as it picks the ordering policy, and the
// long form runs per-row leases (the default scheme).
func soakOnLanes(t *testing.T, form string, seed uint64) bool {
	switch v := os.Getenv("OUTBOX_SOAK_FENCE"); v {
	case "":
		return form == "short" && (seed>>1)%2 == 1
	case "rows":
		return false
	case "lanes":
		return true
	default:
		t.Fatalf("OUTBOX_SOAK_FENCE must be rows or lanes, got %q", v)
		return false
	}
}

func runSoak(t *testing.T, cfg soakConfig, form string, seed uint64, policy fencing.OrderingPolicy, lanes bool) {
	ev := testdb.New(t)
	ev.DB.SetMaxOpenConns(12)
	_, err := ev.DB.Exec(createEvidence)
	require.NoError(t, err)

	// The outbox side: a throwaway cluster the restart fault may restart.
	var cluster *testdb.Cluster
	var ob *testdb.Schema
	restartSkipped := ""
	c, err := testdb.Throwaway(t, "-c max_connections=120 -c shared_buffers=64MB")
	if err != nil {
		restartSkipped = err.Error()
		fmt.Printf("\n!!!!!!!! chaos soak: the PostgreSQL restart fault is SKIPPED: %v.\n"+
			"!!!!!!!! The shared server must never be restarted, so the outbox runs there without that fault; every other fault and check runs.\n\n", err)
		t.Logf("PostgreSQL restart fault SKIPPED: %v", err)
		ob = testdb.New(t)
	} else {
		cluster = c
		ob = testdb.NewOn(t, c.URL)
	}
	ob.DB.SetMaxOpenConns(8)
	_, err = ob.DB.Exec(fmt.Sprintf(createOutboxSide, pq.QuoteIdentifier(ob.Name)))
	require.NoError(t, err)

	if lanes {
		// The lanes' index, as `outboxctl lanes set 32` builds it.
		require.NoError(t, fencing.SetLaneCount(context.Background(), ob.DB, 32, 25))
	}
	bin := buildRelay(t)
	proxy := startProxy(t, ob.URL)
	runID := randomHex(4)
	appName := "chaosrelay_" + runID
	fl := &fleet{t: t, bin: bin, seed: seed, dir: t.TempDir(), killed: map[string]bool{}, policy: policy, lanes: lanes,
		relayDSN: withParams(t, ob.URL, map[string]string{"host": proxy.Listen, "application_name": appName}),
		sinkDSN:  withParams(t, ev.URL, map[string]string{"application_name": "chaossink_" + runID})}
	t.Cleanup(fl.killAll)
	for i := range cfg.relays {
		fl.start(i)
	}

	ctx, cancel := context.WithTimeout(context.Background(), cfg.window+2*time.Minute)
	defer cancel()
	prod := &ledger{committed: map[string]bool{}, rolledBack: map[string]bool{}, poison: map[string]bool{},
		large: map[string]bool{}, unknown: map[string][]string{}, committedTx: map[string]bool{}}
	var restartsOn atomic.Bool
	restartsOn.Store(cluster != nil)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		poison(ctx, t, ob.DB, cfg, prod, &restartsOn)
	}()
	for p := range cfg.producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			produce(ctx, t, ob.DB, cfg, p, seed, prod, &restartsOn)
		}()
	}
	rng := mrand.New(mrand.NewPCG(seed, 0xfa17))
	inj := &injector{rng: rng, fleet: fl, proxy: proxy, db: ob.DB, ev: ev.DB, app: appName, cluster: cluster,
		pools: []*sql.DB{ob.DB}, budget: cfg.budget, counts: map[string]int{}}
	if cluster != nil {
		inj.scheduleRestarts(cfg)
	}
	op := newOperator(t, ob.DB, ev.DB, cfg, seed, inj)
	opDone := make(chan struct{})
	go func() {
		defer close(opDone)
		op.run(ctx, cfg.window)
	}()
	retCtx, retStop := context.WithCancel(context.Background())
	defer retStop()
	retDone := make(chan struct{})
	go func() {
		defer close(retDone)
		op.retain(retCtx)
	}()
	cons := newConsumer(t, ev.DB, seed)
	consDone := make(chan struct{})
	go func() {
		defer close(consDone)
		cons.run()
	}()
	wg.Add(1)
	go func() {
		defer wg.Done()
		inj.run(ctx, cfg.window)
	}()
	// A broker outage longer than the relays' whole retry horizon (their
	// backoff sums to about 21.5 s over 25 attempts), in the middle of the
	// fault window, with producers writing on: it must park nothing.
	wg.Add(1)
	go func() {
		defer wg.Done()
		select {
		case <-ctx.Done():
			return
		case <-time.After(cfg.window / 3):
		}
		_, err := ev.DB.Exec(`UPDATE chaos_outage SET until = clock_timestamp() + $1 * interval '1 second'`, outageFor.Seconds())
		if err == nil {
			_, err = ev.DB.Exec(`INSERT INTO chaos_fault (owner, kind) VALUES ('test', 'downstream-outage')`)
		}
		if err != nil {
			t.Errorf("start the outage: %v", err)
		}
	}()
	// The downstream that hangs forever (ignoring its context) over a
	// window; meanwhile relays that report claims paused get SIGTERM and
	// must drain and exit.
	wg.Add(1)
	go func() {
		defer wg.Done()
		inj.hangWindow(ctx, cfg)
	}()
	wg.Wait()
	inj.heal()

	countUnsettled := countUnsettledBlock
	if policy == fencing.SkipParked {
		countUnsettled = countUnsettledSkip
	}
	require.Eventually(t, func() bool {
		var n int
		// The operator's last redrive may still be running: its rows must
		// be delivered too, so settling waits for it.
		select {
		case <-opDone:
		default:
			return false
		}
		return ob.DB.QueryRow(countUnsettled).Scan(&n) == nil && n == 0
	}, cfg.settle, 200*time.Millisecond, "rows still unsettled after the faults healed (seed %d)", seed)
	retStop()
	<-retDone
	finals := fl.stopAll()
	cons.finish()
	select {
	case <-consDone:
	case <-time.After(2 * time.Minute):
		t.Fatalf("the inbox consumer did not catch up with the delivery log within 2 minutes")
	}

	sum := check(t, ob.DB, ev.DB, prod, fl, op, cons, inj, policy, cfg, finals)
	sum.restartSkipped = restartSkipped
	sum.faults = inj.faultCounts()
	var kind string
	var n int
	rows, err := ev.DB.Query(`SELECT kind, count(*) FROM chaos_fault GROUP BY kind ORDER BY kind`)
	require.NoError(t, err)
	for rows.Next() {
		require.NoError(t, rows.Scan(&kind, &n))
		sum.faults[kind] = n
	}
	require.NoError(t, rows.Err())
	fmt.Print(sum.String(form, seed, policy))
	require.Zero(t, sum.lost, "lost messages")
	var parkedByOutage int
	require.NoError(t, ob.DB.QueryRow(`SELECT count(*) FROM messaging_outbox
		WHERE parked_at IS NOT NULL AND last_failure_detail LIKE '%' || $1 || '%'`, outageError).Scan(&parkedByOutage))
	require.Zero(t, parkedByOutage, "rows parked by the broker outage")
}

// The outage: how long, and what the downstream answers meanwhile
// (relayproc's text; the check above looks for it in parked rows).
const (
	outageFor = 25 * time.Second
	// One message in largeEvery carries a payload of largePayload bytes.
	largeEvery   = 40
	largePayload = 256 << 10
	outageError  = "chaos outage: broker unavailable"
)

// ---- producers ----

// topics: the relays serve three destinations, as a relay of a service
// usually does; each has its own breaker, so a downstream that hangs on
// everything leaves behind more publishes than one breaker lets through
// before it opens, and MaxAbandoned is what bounds them. A key's rows all
// go to one destination (chosen by the key).
var topics = []string{"chaos.events", "chaos.audit", "chaos.billing"}

func topicOf(key string, rng *mrand.Rand) string {
	if key == "" {
		return topics[rng.IntN(len(topics))]
	}
	h := 0
	for _, c := range key {
		h = h*31 + int(c)
	}
	return topics[(h&0x7fffffff)%len(topics)]
}

type ledger struct {
	mu                    sync.Mutex
	committed, rolledBack map[string]bool
	poison                map[string]bool // committed rows no relay can turn into a message
	large                 map[string]bool // messages with a largePayload-byte payload
	// unknown: transactions whose commit was cut by a PostgreSQL restart
	// (the connection died: committed or not, the client cannot tell), by
	// their business row's id, with their message ids. The verdict settles
	// each by its business row: committed with all its messages, or none.
	unknown            map[string][]string
	unknownPoison      map[string]bool
	committedTx        map[string]bool // business row ids of committed transactions
	commits, rollbacks int
}

// connectionLost reports an error of a connection the server dropped or
// refused (a restart): the only producer errors the soak accepts, and only
// when it restarts the server.
func connectionLost(err error) bool {
	var pe *pq.Error
	var ne net.Error
	switch {
	case err == nil:
		return false
	case errors.Is(err, driver.ErrBadConn), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.As(err, &ne):
		return true
	case errors.As(err, &pe):
		return pe.Code.Class() == "57" || pe.Code.Class() == "08"
	}
	s := err.Error()
	for _, m := range []string{"connection refused", "broken pipe", "connection reset", "the database system is", "bad connection", "unexpected EOF"} {
		if strings.Contains(s, m) {
			return true
		}
	}
	return false
}

// poisonHeaders are stored headers written by SQL (the README addresses
// people who write SQL against the table) that the envelope refuses: not a
// flat string object, or a reserved msg.* name.
var poisonHeaders = []string{`{"n": 1}`, `{"a": {"b": "c"}}`, `{"msg.bogus": "x"}`, `{"msg.tenant": "acme"}`}

// poison writes cfg.poison rows by SQL over the fault window, each in a
// transaction with a good row published beside it, so the two share
// batches: the poison row must be parked FAILED with its reason, the good
// one delivered.
func poison(ctx context.Context, t *testing.T, db *sql.DB, cfg soakConfig, l *ledger, restarts *atomic.Bool) {
	if cfg.poison == 0 {
		return
	}
	tick := time.NewTicker(cfg.window / time.Duration(cfg.poison+1))
	defer tick.Stop()
	for i := range cfg.poison {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		bad, good := "poison-"+watermill.NewUUID(), watermill.NewUUID()
		payload, _ := json.Marshal(map[string]any{"id": good, "producer": "poison"})
		err := publisher.InTx(ctx, db, publisher.Config{LockOrderingKeys: true}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			if _, err := tx.ExecContext(ctx, insertBusiness, bad); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ($1, $2, '\x00', $3::jsonb)`,
				bad, topics[i%len(topics)], poisonHeaders[i%len(poisonHeaders)]); err != nil {
				return err
			}
			return pub.Publish(topics[i%len(topics)], message.NewMessage(good, payload))
		})
		l.mu.Lock()
		switch {
		case err == nil:
			l.commits++
			l.committed[bad], l.committed[good], l.poison[bad] = true, true, true
			l.committedTx[bad] = true
		case restarts.Load() && connectionLost(err):
			l.unknown[bad] = []string{bad, good}
			if l.unknownPoison == nil {
				l.unknownPoison = map[string]bool{}
			}
			l.unknownPoison[bad] = true
		default:
			t.Errorf("poison %d: %v", i, err)
		}
		l.mu.Unlock()
	}
}

var errRollBackOnPurpose = errors.New("rolled back on purpose")

func produce(ctx context.Context, t *testing.T, db *sql.DB, cfg soakConfig, p int, seed uint64, l *ledger, restarts *atomic.Bool) {
	rng := mrand.New(mrand.NewPCG(seed, uint64(p)+1))
	perProducer := cfg.messages / cfg.producers
	// Paced over the fault window so faults hit relays under load.
	interval := cfg.window * 5 / 2 / time.Duration(perProducer+1)
	tick := time.NewTicker(max(interval, time.Millisecond))
	defer tick.Stop()
	for made := 0; made < perProducer; {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		n := min(1+rng.IntN(4), perProducer-made)
		made += n
		ids := make([]string, n)
		msgs := make([]*message.Message, n)
		large := make([]bool, n)
		for i := range n {
			ids[i] = watermill.NewUUID()
			body := map[string]any{"id": ids[i], "producer": p}
			if rng.IntN(largeEvery) == 0 {
				// A large payload, over the links the proxy slows down.
				body["pad"] = strings.Repeat("x", largePayload)
				large[i] = true
			}
			payload, _ := json.Marshal(body)
			msgs[i] = message.NewMessage(ids[i], payload)
			// Keyed traffic as services have it: a few hot keys (long chains)
			// and many small ones. Some messages are rejected by the
			// downstream for good (until the operator heals and redrives
			// them): unkeyed ones, and a few on the small keys, where a
			// parked row holds back its key (BlockKey) or is skipped
			// (SkipParked).
			switch r := rng.Float64(); {
			case r < 0.3:
				envelope.SetOrderingKey(msgs[i], fmt.Sprintf("hot-%d", rng.IntN(3)))
			case r < 0.7:
				envelope.SetOrderingKey(msgs[i], fmt.Sprintf("key-%03d", rng.IntN(cfg.keys)))
				if rng.IntN(40) == 0 {
					msgs[i].Metadata.Set("chaos-fate", "reject")
				}
			case r < 0.74:
				msgs[i].Metadata.Set("chaos-fate", "reject")
			}
		}
		// The producers share hot keys and do not otherwise serialise their
		// writers, so they take the per-key lock the README recommends for
		// that case: seq order is then commit order within a key, which the
		// per-key order check below relies on. (Without it a transaction
		// that commits after a later seq of its key was published is
		// published after it, by design; large payloads, slow to write,
		// made that happen in a long run: seq 6090 of hot-1 before 6088.)
		dests := make([]string, n)
		for i, m := range msgs {
			dests[i] = topicOf(m.Metadata.Get(envelope.KeyOrderingKey), rng)
		}
		rollback := rng.Float64() < 0.1
		err := publisher.InTx(ctx, db, publisher.Config{LockOrderingKeys: true}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			if _, err := tx.ExecContext(ctx, insertBusiness, ids[0]); err != nil {
				return err
			}
			// One Publish per destination, in a fixed order: a key's rows
			// all go to one destination, so each call takes its keys'
			// locks (sorted) and the calls never cross (no deadlock
			// between producers).
			for _, dest := range topics {
				var group []*message.Message
				for i, m := range msgs {
					if dests[i] == dest {
						group = append(group, m)
					}
				}
				if len(group) == 0 {
					continue
				}
				if err := pub.Publish(dest, group...); err != nil {
					return err
				}
			}
			if rollback {
				return errRollBackOnPurpose
			}
			return nil
		})
		l.mu.Lock()
		switch {
		case errors.Is(err, errRollBackOnPurpose):
			l.rollbacks++
			for _, id := range ids {
				l.rolledBack[id] = true
			}
		case err == nil:
			l.commits++
			l.committedTx[ids[0]] = true
			for i, id := range ids {
				l.committed[id] = true
				if large[i] {
					l.large[id] = true
				}
			}
		case restarts.Load() && connectionLost(err):
			l.unknown[ids[0]] = ids
			for i, id := range ids {
				if large[i] {
					l.large[id] = true
				}
			}
		default:
			t.Errorf("producer %d: %v", p, err)
		}
		l.mu.Unlock()
	}
}

// ---- helpers ----

func withParams(t *testing.T, base string, params map[string]string) string {
	t.Helper()
	u, err := url.Parse(base)
	require.NoError(t, err)
	q := u.Query()
	for k, v := range params {
		if k == "host" {
			u.Host = v
			continue
		}
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
