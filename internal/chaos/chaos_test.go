package chaos_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	_ "github.com/Shopify/toxiproxy/v2/toxics" // registers the latency toxic
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// The soak's evidence tables, in the test schema. chaos_delivery is the
// downstream's durable log: one row per accepted delivery, written by the
// relay process over its own direct connection before Publish returns; its
// identity column orders deliveries in real time across processes (a row
// is inserted only after the previous delivery of the same key committed).
const createEvidence = `
CREATE TABLE chaos_business (tx_id text PRIMARY KEY);
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
CREATE TABLE chaos_fault (owner text NOT NULL, kind text NOT NULL);
CREATE TABLE chaos_outage (until timestamptz);
INSERT INTO chaos_outage VALUES (NULL);`

const (
	insertBusiness = `INSERT INTO chaos_business (tx_id) VALUES ($1)`
	// unsettled: rows that are neither terminal nor held back by a parked
	// earlier row of their ordering key (BlockKey policy).
	countUnsettled = `
SELECT count(*) FROM messaging_outbox o
 WHERE o.status NOT IN ('PUBLISHED', 'FAILED', 'EXHAUSTED')
   AND NOT EXISTS (SELECT 1 FROM messaging_outbox e
                    WHERE e.ordering_key = o.ordering_key AND e.seq < o.seq
                      AND e.status IN ('FAILED', 'EXHAUSTED'))`
	terminateRelays = `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`
	selectRows      = `SELECT message_id, status, seq, coalesce(ordering_key, ''), coalesce(lease_owner, ''), lease_token,
       coalesce(last_failure_code, ''), headers->>'chaos-fate' IS NOT NULL,
       lease_expires_at IS NOT NULL AND lease_expires_at < now()
  FROM messaging_outbox`
	selectDeliveries = `SELECT message_id, logical_id, coalesce(ordering_key, ''), owner, lease_token, outcome
  FROM chaos_delivery ORDER BY delivery_id`
	topic        = "chaos.events"
	leaseForSoak = 2 * time.Second // relayproc's LeaseDuration
)

type soakConfig struct {
	relays, producers, messages, keys int
	poison                            int // rows written by SQL that no relay can turn into a message
	window                            time.Duration
	budget                            map[string]int // faults injected by the test, per kind
}

func configFromEnv() (soakConfig, string) {
	if os.Getenv("OUTBOX_SOAK") == "long" {
		return soakConfig{relays: 4, producers: 3, messages: 6000, keys: 400, window: 4 * time.Minute, poison: 60,
			budget: map[string]int{"sigkill": 40, "sigstop": 20, "conn-cut": 20, "conn-latency": 20, "pg-terminate": 20}}, "long"
	}
	return soakConfig{relays: 3, producers: 2, messages: 500, keys: 150, window: 25 * time.Second, poison: 8,
		budget: map[string]int{"sigkill": 4, "sigstop": 2, "conn-cut": 2, "conn-latency": 2, "pg-terminate": 2}}, "short"
}

func TestChaosSoak(t *testing.T) {
	cfg, form := configFromEnv()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("OUTBOX_SOAK_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "OUTBOX_SOAK_SEED")
		seed = n
	}
	fmt.Printf("chaos soak (%s): seed %d (replay the fault schedule with OUTBOX_SOAK_SEED=%d)\n", form, seed, seed)

	s := testdb.New(t)
	s.DB.SetMaxOpenConns(8)
	_, err := s.DB.Exec(createEvidence)
	require.NoError(t, err)

	bin := buildRelay(t)
	proxy := startProxy(t)
	runID := randomHex(4)
	appName := "chaosrelay_" + runID
	fl := &fleet{t: t, bin: bin, seed: seed, dir: t.TempDir(), killed: map[string]bool{},
		relayDSN: withParams(t, s.URL, map[string]string{"host": proxy.Listen, "application_name": appName}),
		sinkDSN:  withParams(t, s.URL, map[string]string{"application_name": "chaossink_" + runID})}
	t.Cleanup(fl.killAll)
	for i := range cfg.relays {
		fl.start(i)
	}

	ctx, cancel := context.WithTimeout(context.Background(), cfg.window+2*time.Minute)
	defer cancel()
	prod := &ledger{committed: map[string]bool{}, rolledBack: map[string]bool{}, poison: map[string]bool{}, large: map[string]bool{}}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		poison(ctx, t, s.DB, cfg, prod)
	}()
	for p := range cfg.producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			produce(ctx, t, s.DB, cfg, p, seed, prod)
		}()
	}
	inj := &injector{rng: mrand.New(mrand.NewPCG(seed, 0xfa17)), fleet: fl, proxy: proxy, db: s.DB, app: appName,
		budget: cfg.budget, counts: map[string]int{}}
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
		_, err := s.DB.Exec(`UPDATE chaos_outage SET until = clock_timestamp() + $1 * interval '1 second'`, outageFor.Seconds())
		if err == nil {
			_, err = s.DB.Exec(`INSERT INTO chaos_fault (owner, kind) VALUES ('test', 'downstream-outage')`)
		}
		if err != nil {
			t.Errorf("start the outage: %v", err)
		}
	}()
	wg.Wait()
	inj.heal()

	settleWithin := 90 * time.Second
	if form == "long" {
		settleWithin = 5 * time.Minute
	}
	require.Eventually(t, func() bool {
		var n int
		return s.DB.QueryRow(countUnsettled).Scan(&n) == nil && n == 0
	}, settleWithin, 200*time.Millisecond, "rows still unsettled after the faults healed (seed %d)", seed)
	fl.stopAll()

	sum := check(t, s.DB, prod, fl)
	sum.faults = inj.counts
	var kind string
	var n int
	rows, err := s.DB.Query(`SELECT kind, count(*) FROM chaos_fault GROUP BY kind ORDER BY kind`)
	require.NoError(t, err)
	for rows.Next() {
		require.NoError(t, rows.Scan(&kind, &n))
		sum.faults[kind] = n
	}
	require.NoError(t, rows.Err())
	fmt.Print(sum.String(form, seed))
	require.Zero(t, sum.lost, "lost messages")
	var parkedByOutage int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox
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

type ledger struct {
	mu                    sync.Mutex
	committed, rolledBack map[string]bool
	poison                map[string]bool // committed rows no relay can turn into a message
	large                 map[string]bool // messages with a largePayload-byte payload
	commits, rollbacks    int
}

// poisonHeaders are stored headers written by SQL (the README addresses
// people who write SQL against the table) that the envelope refuses: not a
// flat string object, or a reserved msg.* name.
var poisonHeaders = []string{`{"n": 1}`, `{"a": {"b": "c"}}`, `{"msg.bogus": "x"}`, `{"msg.tenant": "acme"}`}

// poison writes cfg.poison rows by SQL over the fault window, each in a
// transaction with a good row published beside it, so the two share
// batches: the poison row must be parked FAILED with its reason, the good
// one delivered.
func poison(ctx context.Context, t *testing.T, db *sql.DB, cfg soakConfig, l *ledger) {
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
				bad, topic, poisonHeaders[i%len(poisonHeaders)]); err != nil {
				return err
			}
			return pub.Publish(topic, message.NewMessage(good, payload))
		})
		if err != nil {
			t.Errorf("poison %d: %v", i, err)
			continue
		}
		l.mu.Lock()
		l.commits++
		l.committed[bad], l.committed[good], l.poison[bad] = true, true, true
		l.mu.Unlock()
	}
}

var errRollBackOnPurpose = errors.New("rolled back on purpose")

func produce(ctx context.Context, t *testing.T, db *sql.DB, cfg soakConfig, p int, seed uint64, l *ledger) {
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
			// and many small ones.
			switch r := rng.Float64(); {
			case r < 0.3:
				envelope.SetOrderingKey(msgs[i], fmt.Sprintf("hot-%d", rng.IntN(3)))
			case r < 0.7:
				envelope.SetOrderingKey(msgs[i], fmt.Sprintf("key-%03d", rng.IntN(cfg.keys)))
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
		rollback := rng.Float64() < 0.1
		err := publisher.InTx(ctx, db, publisher.Config{LockOrderingKeys: true}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
			if _, err := tx.ExecContext(ctx, insertBusiness, ids[0]); err != nil {
				return err
			}
			if err := pub.Publish(topic, msgs...); err != nil {
				return err
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
			for i, id := range ids {
				l.committed[id] = true
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

// ---- relay processes ----

type fleet struct {
	t                 *testing.T
	bin, dir          string
	relayDSN, sinkDSN string
	seed              uint64

	mu     sync.Mutex
	slots  []*relay
	killed map[string]bool // owners that were SIGKILLed
	owners []string
}

type relay struct {
	owner  string
	cmd    *exec.Cmd
	done   chan error
	paused bool
	log    string
}

func (f *fleet) start(i int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for len(f.slots) <= i {
		f.slots = append(f.slots, nil)
	}
	inc := 0
	for _, o := range f.owners {
		if strings.HasPrefix(o, fmt.Sprintf("relay%d-", i)) {
			inc++
		}
	}
	owner := fmt.Sprintf("relay%d-%d", i, inc)
	logPath := filepath.Join(f.dir, owner+".log")
	logFile, err := os.Create(logPath)
	require.NoError(f.t, err)
	args := []string{"-dsn", f.relayDSN, "-sink-dsn", f.sinkDSN, "-owner", owner,
		"-seed", strconv.FormatUint(f.seed+uint64(i)*1000+uint64(inc), 10)}
	if i == 1 {
		args = append(args, "-no-prefetch") // one relay of the fleet claims without pipelining
	}
	cmd := exec.Command(f.bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	require.NoError(f.t, cmd.Start())
	r := &relay{owner: owner, cmd: cmd, done: make(chan error, 1), log: logPath}
	go func() {
		r.done <- cmd.Wait()
		_ = logFile.Close()
	}()
	f.slots[i] = r
	f.owners = append(f.owners, owner)
}

// kill SIGKILLs relay i (mid-pass, wherever it is) and starts a new one.
func (f *fleet) kill(i int) {
	f.mu.Lock()
	r := f.slots[i]
	f.killed[r.owner] = true
	f.mu.Unlock()
	_ = r.cmd.Process.Signal(syscall.SIGKILL)
	<-r.done
	f.start(i)
}

func (f *fleet) signal(i int, sig syscall.Signal, paused bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.slots[i].paused = paused
	_ = f.slots[i].cmd.Process.Signal(sig)
}

// pick returns a random relay that is not paused, or -1.
func (f *fleet) pick(rng *mrand.Rand) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	var free []int
	for i, r := range f.slots {
		if !r.paused {
			free = append(free, i)
		}
	}
	if len(free) == 0 {
		return -1
	}
	return free[rng.IntN(len(free))]
}

// diedBeforeMain reports a relay killed by the SIGTERM itself: relayproc
// installs its SIGTERM handler as the first statement of main, so such a
// relay was still starting (restarted just before the stop) and had claimed
// nothing. Every relay that got further must drain and exit cleanly.
func diedBeforeMain(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM
}

// stopAll asks every relay to stop (SIGTERM: drain and exit) and requires a
// clean exit (or, see diedBeforeMain, one that never started).
func (f *fleet) stopAll() {
	f.mu.Lock()
	slots := append([]*relay(nil), f.slots...)
	f.mu.Unlock()
	for _, r := range slots {
		_ = r.cmd.Process.Signal(syscall.SIGCONT)
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, r := range slots {
		select {
		case err := <-r.done:
			if err != nil && !diedBeforeMain(err) {
				f.t.Errorf("relay %s exited with %v; log:\n%s", r.owner, err, tail(r.log))
			}
			r.done <- err // killAll reads it to see that this relay exited
		case <-time.After(30 * time.Second):
			f.t.Errorf("relay %s did not stop within 30s after SIGTERM; log:\n%s", r.owner, tail(r.log))
		}
	}
}

// killAll SIGKILLs every relay that has not exited (the cleanup after a
// failure). A relay has exited once Wait's result is in its done channel:
// read it through the channel rather than cmd.ProcessState, which Wait sets
// on another goroutine.
func (f *fleet) killAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.slots {
		if r == nil {
			continue
		}
		select {
		case err := <-r.done:
			r.done <- err
		default:
			_ = r.cmd.Process.Signal(syscall.SIGKILL)
		}
	}
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

func buildRelay(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = "/usr/local/go/bin/go"
	}
	bin := filepath.Join(t.TempDir(), "relayproc")
	out, err := exec.Command(goBin, "build", "-o", bin, "./relayproc").CombinedOutput()
	require.NoError(t, err, "build relayproc: %s", out)
	return bin
}

// ---- faults injected by the test ----

func startProxy(t *testing.T) *toxiproxy.Proxy {
	t.Helper()
	u, err := url.Parse(testdb.URL())
	require.NoError(t, err, "OUTBOX_TEST_DATABASE_URL must be a URL for the soak")
	upstream := u.Host
	if u.Port() == "" {
		upstream = net.JoinHostPort(u.Hostname(), "5432")
	}
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(srv, "postgres", "127.0.0.1:0", upstream)
	require.NoError(t, p.Start())
	t.Cleanup(p.Stop)
	return p
}

type injector struct {
	rng    *mrand.Rand
	fleet  *fleet
	proxy  *toxiproxy.Proxy
	db     *sql.DB
	app    string
	budget map[string]int

	mu      sync.Mutex
	counts  map[string]int
	pending sync.WaitGroup // faults that heal themselves later
	cutting bool
	latent  bool
}

func (in *injector) run(ctx context.Context, window time.Duration) {
	deadline := time.Now().Add(window)
	kinds := []string{"sigkill", "sigstop", "conn-cut", "conn-latency", "pg-terminate"}
	for time.Now().Before(deadline) {
		wait := time.NewTimer(time.Duration(500+in.rng.IntN(1500)) * time.Millisecond)
		select {
		case <-ctx.Done():
			wait.Stop()
			return
		case <-wait.C:
		}
		kind := kinds[in.rng.IntN(len(kinds))]
		if in.counts[kind] >= in.budget[kind] {
			continue
		}
		if in.inject(kind) {
			in.mu.Lock()
			in.counts[kind]++
			in.mu.Unlock()
		}
	}
	in.pending.Wait()
}

// inject starts one fault; faults with a duration heal themselves on a
// timer (the fault's length is the point, not a guess at when something
// happened).
func (in *injector) inject(kind string) bool {
	switch kind {
	case "sigkill":
		i := in.fleet.pick(in.rng)
		if i < 0 {
			return false
		}
		in.fleet.kill(i)
	case "sigstop":
		i := in.fleet.pick(in.rng)
		if i < 0 {
			return false
		}
		in.fleet.signal(i, syscall.SIGSTOP, true)
		in.later(leaseForSoak+time.Second+time.Duration(in.rng.IntN(1000))*time.Millisecond, func() {
			in.fleet.signal(i, syscall.SIGCONT, false)
		})
	case "conn-cut":
		in.mu.Lock()
		busy := in.cutting
		in.cutting = true
		in.mu.Unlock()
		if busy {
			return false
		}
		in.proxy.Stop() // closes every relay connection and refuses new ones
		in.later(time.Duration(300+in.rng.IntN(700))*time.Millisecond, func() {
			_ = in.proxy.Start()
			in.mu.Lock()
			in.cutting = false
			in.mu.Unlock()
		})
	case "conn-latency":
		in.mu.Lock()
		busy := in.latent
		in.latent = true
		in.mu.Unlock()
		if busy {
			return false
		}
		_, err := in.proxy.Toxics.AddToxicJson(strings.NewReader(
			`{"name":"chaos_latency","type":"latency","stream":"downstream","attributes":{"latency":300,"jitter":200}}`))
		if err != nil {
			in.fleet.t.Errorf("add latency toxic: %v", err)
			in.mu.Lock()
			in.latent = false
			in.mu.Unlock()
			return false
		}
		in.later(time.Duration(1000+in.rng.IntN(2000))*time.Millisecond, func() {
			_ = in.proxy.Toxics.RemoveToxic(context.Background(), "chaos_latency")
			in.mu.Lock()
			in.latent = false
			in.mu.Unlock()
		})
	case "pg-terminate":
		var n int
		if err := in.db.QueryRow(terminateRelays, in.app).Scan(&n); err != nil {
			in.fleet.t.Errorf("pg_terminate_backend: %v", err)
			return false
		}
	}
	return true
}

func (in *injector) later(d time.Duration, heal func()) {
	in.pending.Add(1)
	go func() {
		defer in.pending.Done()
		t := time.NewTimer(d)
		<-t.C
		heal()
	}()
}

// heal ends every fault still active (run already waited for the timed
// ones; this is the belt to that).
func (in *injector) heal() {
	in.pending.Wait()
	if !in.proxy.Enabled {
		_ = in.proxy.Start()
	}
	for i := range in.fleet.slots {
		in.fleet.signal(i, syscall.SIGCONT, false)
	}
}

// ---- the verdict ----

type row struct {
	status, key, owner, code string
	seq, token               int64
	fatedReject, expired     bool
}

type delivery struct {
	id, logical, key, owner, outcome string
	token                            int64
}

type summary struct {
	committed, rolledBackTx, rolledBackMsgs, commits int
	deliveries, delivered, duplicates                int
	published, failed, exhausted, blocked, lost      int
	poisonParked                                     int
	large, largeDelivered                            int
	staleReported, staleEvidence, unwritten          int
	unrecordedReported, unrecordedObserved           int
	claimFailures, claimReleased                     int
	killed                                           int
	faults                                           map[string]int
}

func (s summary) String(form string, seed uint64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "chaos soak summary (%s, seed %d)\n", form, seed)
	fmt.Fprintf(&b, "  messages committed      %d (in %d transactions)\n", s.committed, s.commits)
	fmt.Fprintf(&b, "  messages rolled back    %d (in %d transactions; delivered: 0)\n", s.rolledBackMsgs, s.rolledBackTx)
	fmt.Fprintf(&b, "  deliveries              %d (distinct messages %d, duplicates %d)\n", s.deliveries, s.delivered, s.duplicates)
	fmt.Fprintf(&b, "  rows PUBLISHED          %d\n", s.published)
	fmt.Fprintf(&b, "  parked FAILED           %d\n", s.failed)
	fmt.Fprintf(&b, "  parked EXHAUSTED        %d\n", s.exhausted)
	fmt.Fprintf(&b, "  blocked behind parked   %d\n", s.blocked)
	fmt.Fprintf(&b, "  stale writes reported   %d (confirmed deliveries whose outcome was overwritten: %d, all reported)\n", s.staleReported, s.staleEvidence)
	fmt.Fprintf(&b, "  poison rows parked      %d (written by SQL beside good rows; FAILED with their reason, never delivered)\n", s.poisonParked)
	fmt.Fprintf(&b, "  large payloads          %d committed (%d KiB each, over the proxied links), %d delivered (the rest parked, or held behind a parked row of their key: checked with every row)\n", s.large, largePayload>>10, s.largeDelivered)
	fmt.Fprintf(&b, "  outcome writes failed   %d (rows of failed outcome statements, logged by id and lease token)\n", s.unwritten)
	fmt.Fprintf(&b, "  unrecorded publishes    %d reported in Report.UnrecordedPublishes (confirmed deliveries among the failed outcome writes: %d)\n", s.unrecordedReported, s.unrecordedObserved)
	fmt.Fprintf(&b, "  failed claims           %d (rows released without an attempt: %d)\n", s.claimFailures, s.claimReleased)
	kinds := make([]string, 0, len(s.faults))
	for k := range s.faults {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	fmt.Fprintf(&b, "  faults injected        ")
	for _, k := range kinds {
		fmt.Fprintf(&b, " %s=%d", k, s.faults[k])
	}
	fmt.Fprintf(&b, "\n  relay incarnations killed %d\n", s.killed)
	fmt.Fprintf(&b, "  lost                    %d\n", s.lost)
	return b.String()
}

type lease struct {
	owner, id string
	token     int64
}

func check(t *testing.T, db *sql.DB, l *ledger, fl *fleet) summary {
	t.Helper()
	var sum summary
	l.mu.Lock()
	defer l.mu.Unlock()
	sum.committed, sum.commits = len(l.committed), l.commits
	sum.rolledBackMsgs, sum.rolledBackTx = len(l.rolledBack), l.rollbacks
	require.Positive(t, sum.committed)

	rows := map[string]*row{}
	rs, err := db.Query(selectRows)
	require.NoError(t, err)
	for rs.Next() {
		var id string
		r := &row{}
		require.NoError(t, rs.Scan(&id, &r.status, &r.seq, &r.key, &r.owner, &r.token, &r.code, &r.fatedReject, &r.expired))
		rows[id] = r
	}
	require.NoError(t, rs.Err())

	var deliveries []delivery
	ds, err := db.Query(selectDeliveries)
	require.NoError(t, err)
	for ds.Next() {
		var d delivery
		require.NoError(t, ds.Scan(&d.id, &d.logical, &d.key, &d.owner, &d.token, &d.outcome))
		deliveries = append(deliveries, d)
	}
	require.NoError(t, ds.Err())
	sum.deliveries = len(deliveries)

	// Committed = stored, rolled back = absent and never delivered.
	for id := range l.committed {
		require.Contains(t, rows, id, "committed message %s has no row", id)
	}
	for id := range rows {
		require.True(t, l.committed[id], "row %s was not committed by a producer", id)
	}
	delivered := map[string]int{}
	for _, d := range deliveries {
		require.False(t, l.rolledBack[d.id], "message %s from a rolled-back transaction was delivered", d.id)
		// A duplicate is the same message under the same id: the id the
		// producer put in the payload is the id the downstream saw.
		require.Equal(t, d.logical, d.id, "delivery under a re-minted id")
		delivered[d.id]++
	}
	sum.delivered = len(delivered)
	for id := range l.large {
		sum.large++
		if delivered[id] > 0 {
			sum.largeDelivered++
		}
	}
	sum.duplicates = sum.deliveries - sum.delivered

	// Per ordering key: the first deliveries are exactly the key's rows in
	// seq order, without a gap (a prefix of the key's rows). A later
	// delivery of an earlier row is a duplicate of a row already delivered.
	byKey := map[string][]int64{}
	for _, r := range rows {
		if r.key != "" {
			byKey[r.key] = append(byKey[r.key], r.seq)
		}
	}
	for k := range byKey {
		sort.Slice(byKey[k], func(i, j int) bool { return byKey[k][i] < byKey[k][j] })
	}
	firstSeen := map[string]bool{}
	next := map[string]int{}
	for _, d := range deliveries {
		r := rows[d.id]
		if r.key == "" {
			continue
		}
		if firstSeen[d.id] {
			// A duplicate: its row was first delivered in order above, so
			// it lies in the key's delivered prefix already; nothing more
			// to check about its position.
			continue
		}
		firstSeen[d.id] = true
		want := byKey[r.key][next[r.key]]
		require.Equal(t, want, r.seq, "key %s: first delivery of seq %d while seq %d was not delivered yet", r.key, r.seq, want)
		next[r.key]++
	}

	// Every committed message is delivered, parked with a reason, or held
	// back by a parked earlier row of its key; nothing else (lost).
	parkedBefore := func(r *row) bool {
		for _, s := range byKey[r.key] {
			if s >= r.seq {
				return false
			}
			for _, o := range rows {
				if o.seq == s && (o.status == string(envelope.StatusFailed) || o.status == string(envelope.StatusExhausted)) {
					return true
				}
			}
		}
		return false
	}
	for id, r := range rows {
		require.False(t, r.expired && r.status == string(envelope.StatusInFlight), "row %s left IN_FLIGHT with an expired lease", id)
		require.NotEqual(t, string(envelope.StatusInFlight), r.status, "row %s left IN_FLIGHT after the relays drained", id)
		switch {
		case l.poison[id]:
			require.Equal(t, string(envelope.StatusFailed), r.status, "poison row %s", id)
			require.Contains(t, []string{"OUTBOX_CORRUPT_ROW", "OUTBOX_RESERVED_HEADER"}, r.code, "poison row %s", id)
			require.Zero(t, delivered[id], "poison row %s was delivered", id)
			sum.poisonParked++
			sum.failed++
		case r.fatedReject:
			require.Equal(t, string(envelope.StatusFailed), r.status, "message %s the downstream rejects", id)
			require.Equal(t, "CHAOS_REJECTED", r.code)
			require.Zero(t, delivered[id], "a rejected message was delivered")
			sum.failed++
		case r.status == string(envelope.StatusPublished):
			require.Positive(t, delivered[id], "row %s is PUBLISHED but was never delivered", id)
			sum.published++
		case r.status == string(envelope.StatusFailed) || r.status == string(envelope.StatusExhausted):
			require.NotEmpty(t, r.code, "parked row %s without a reason", id)
			if r.status == string(envelope.StatusFailed) {
				sum.failed++
			} else {
				sum.exhausted++
			}
		case r.key != "" && parkedBefore(r):
			sum.blocked++
		default:
			sum.lost++
			t.Errorf("lost: message %s is %s and not held back by a parked row", id, r.status)
		}
	}

	// Stale writes. Reported ones must be real (someone claimed the row
	// after this lease), every confirmed delivery whose PUBLISHED was not
	// written under its own lease must have been reported stale, unless the
	// relay died or its pass failed writing outcomes, and per surviving
	// relay the Report.Stale sum equals the stale events it logged.
	stale := loadLeases(t, db, `SELECT owner, message_id, lease_token FROM chaos_stale`)
	unwritten := loadLeases(t, db, `SELECT owner, message_id, lease_token FROM chaos_unwritten`)
	sum.staleReported, sum.unwritten = len(stale), len(unwritten)
	for lz := range stale {
		require.Greater(t, rows[lz.id].token, lz.token, "stale report for %s token %d, but no later lease exists", lz.id, lz.token)
	}
	fl.mu.Lock()
	killed := fl.killed
	sum.killed = len(killed)
	fl.mu.Unlock()
	for _, d := range deliveries {
		if d.outcome != "confirmed" {
			continue
		}
		r := rows[d.id]
		if r.status == string(envelope.StatusPublished) && r.owner == d.owner && r.token == d.token {
			continue
		}
		lz := lease{d.owner, d.id, d.token}
		switch {
		case stale[lz]:
			sum.staleEvidence++
		case unwritten[lz] || killed[d.owner]:
		default:
			t.Errorf("confirmed delivery of %s by %s (token %d) was overwritten (row %s by %s token %d) and not reported stale",
				d.id, d.owner, d.token, r.status, r.owner, r.token)
		}
	}
	perOwner := map[string][2]int{}
	rep, err := db.Query(`SELECT owner, sum(stale)::int FROM chaos_report GROUP BY owner`)
	require.NoError(t, err)
	for rep.Next() {
		var o string
		var n int
		require.NoError(t, rep.Scan(&o, &n))
		v := perOwner[o]
		v[0] = n
		perOwner[o] = v
	}
	require.NoError(t, rep.Err())
	for lz := range stale {
		v := perOwner[lz.owner]
		v[1]++
		perOwner[lz.owner] = v
	}
	for o, v := range perOwner {
		if !killed[o] {
			require.Equal(t, v[1], v[0], "relay %s: Report.Stale total vs stale events logged", o)
		}
	}

	// Possible duplicates from failed outcome writes: every row a surviving
	// relay counted in Report.UnrecordedPublishes is a confirmed delivery
	// among the rows of its failed outcome statements. (Not always all of
	// them: a publish that the downstream confirmed just as its timeout
	// left it behind is ambiguous for the relay, a possible duplicate it
	// already counts when the row goes out again.)
	reported := map[string]int{}
	rep, err = db.Query(`SELECT owner, sum(unrecorded)::int, sum(claim_failures)::int, sum(claim_released)::int FROM chaos_report GROUP BY owner`)
	require.NoError(t, err)
	for rep.Next() {
		var o string
		var u, cf, cr int
		require.NoError(t, rep.Scan(&o, &u, &cf, &cr))
		reported[o] = u
		sum.unrecordedReported += u
		sum.claimFailures += cf
		sum.claimReleased += cr
	}
	require.NoError(t, rep.Err())
	observed := map[string]int{}
	for _, d := range deliveries {
		if d.outcome == "confirmed" && unwritten[lease{d.owner, d.id, d.token}] {
			observed[d.owner]++
			sum.unrecordedObserved++
		}
	}
	for o, n := range reported {
		if !killed[o] {
			require.LessOrEqual(t, n, observed[o], "relay %s: Report.UnrecordedPublishes vs confirmed deliveries whose outcome write failed", o)
		}
	}
	return sum
}

func loadLeases(t *testing.T, db *sql.DB, q string) map[lease]bool {
	t.Helper()
	out := map[lease]bool{}
	rs, err := db.Query(q)
	require.NoError(t, err)
	defer rs.Close()
	for rs.Next() {
		var lz lease
		require.NoError(t, rs.Scan(&lz.owner, &lz.id, &lz.token))
		out[lz] = true
	}
	require.NoError(t, rs.Err())
	return out
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
