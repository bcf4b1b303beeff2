package chaos_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	_ "github.com/Shopify/toxiproxy/v2/toxics" // registers the latency toxic
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// ---- relay processes ----

type fleet struct {
	t                 *testing.T
	bin, dir          string
	relayDSN, sinkDSN string
	seed              uint64
	policy            fencing.OrderingPolicy
	lanes             bool // the relays run on lanes (OUTBOX_SOAK_FENCE=lanes)

	// ops serialises what stops a relay (SIGKILL by the injector, SIGTERM
	// in the hang window) so two faults never hit one slot at once.
	ops sync.Mutex

	mu     sync.Mutex
	slots  []*relay
	killed map[string]bool // owners that were SIGKILLed
	owners []string
	all    []*relay // every incarnation
	// termed: incarnations stopped by SIGTERM in the hang window, with
	// what they printed at exit.
	termed []termedRelay
}

type termedRelay struct {
	owner string
	final finalLine
	took  time.Duration
}

type relay struct {
	owner   string
	cmd     *exec.Cmd
	exited  chan struct{} // closed once Wait returned; err is then set
	err     error
	paused  bool
	stopped bool // the test stopped it (SIGKILL, or SIGTERM)
	started time.Time
	log     string
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
	ordering := "block"
	if f.policy == fencing.SkipParked {
		ordering = "skip"
	}
	args := []string{"-dsn", f.relayDSN, "-sink-dsn", f.sinkDSN, "-owner", owner,
		"-seed", strconv.FormatUint(f.seed+uint64(i)*1000+uint64(inc), 10),
		"-ordering", ordering, "-max-abandoned", strconv.Itoa(maxAbandonedFlag())}
	if i == 1 {
		args = append(args, "-no-prefetch") // one relay of the fleet claims without pipelining
	}
	if f.lanes {
		args = append(args, "-lanes")
	}
	cmd := exec.Command(f.bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	require.NoError(f.t, cmd.Start())
	r := &relay{owner: owner, cmd: cmd, exited: make(chan struct{}), log: logPath, started: time.Now()}
	go func() {
		r.err = cmd.Wait()
		_ = logFile.Close()
		close(r.exited)
	}()
	f.slots[i] = r
	f.owners = append(f.owners, owner)
	f.all = append(f.all, r)
}

// maxAbandonedFlag is the MaxAbandoned the relays run with:
// relayMaxAbandoned, which the goroutine bound is derived from, unless
// OUTBOX_SOAK_RELAY_MAX_ABANDONED overrides it for the relays alone (to see
// the bound fail: a relay allowed thousands of abandoned publishes leaks a
// goroutine per timed-out attempt while the downstream hangs).
func maxAbandonedFlag() int {
	if v := os.Getenv("OUTBOX_SOAK_RELAY_MAX_ABANDONED"); v != "" {
		n, err := strconv.Atoi(v)
		if err == nil {
			return n
		}
	}
	return relayMaxAbandoned
}

// kill SIGKILLs relay i (mid-pass, wherever it is) and starts a new one.
func (f *fleet) kill(i int) {
	f.ops.Lock()
	defer f.ops.Unlock()
	f.mu.Lock()
	r := f.slots[i]
	f.killed[r.owner] = true
	r.stopped = true
	f.mu.Unlock()
	_ = r.cmd.Process.Signal(syscall.SIGKILL)
	<-r.exited
	f.start(i)
}

// term sends SIGTERM to relay i and requires it to drain and exit cleanly
// within a generous bound, reading what it printed at exit; then starts a
// new one in its place.
func (f *fleet) term(i int) {
	f.ops.Lock()
	defer f.ops.Unlock()
	f.mu.Lock()
	r := f.slots[i]
	r.stopped = true
	paused := r.paused
	f.mu.Unlock()
	if paused {
		_ = r.cmd.Process.Signal(syscall.SIGCONT)
	}
	began := time.Now()
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.exited:
	case <-time.After(30 * time.Second):
		f.t.Errorf("relay %s (publishes hanging) did not exit within 30s after SIGTERM; log:\n%s", r.owner, tail(r.log))
		_ = r.cmd.Process.Signal(syscall.SIGKILL)
		<-r.exited
		f.start(i)
		return
	}
	took := time.Since(began)
	if r.err != nil {
		f.t.Errorf("relay %s (publishes hanging) exited with %v after SIGTERM; log:\n%s", r.owner, r.err, tail(r.log))
	}
	fin, ok := readFinal(r.log)
	if !ok {
		f.t.Errorf("relay %s printed no final line at exit; log:\n%s", r.owner, tail(r.log))
	}
	f.mu.Lock()
	f.termed = append(f.termed, termedRelay{owner: r.owner, final: fin, took: took})
	f.mu.Unlock()
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

// live returns the owners of the relays running now (a relay that exited
// on its own is not waited for here: stopAll fails the soak on it).
func (f *fleet) live() map[string]bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]bool{}
	for _, r := range f.slots {
		select {
		case <-r.exited:
		default:
			out[r.owner] = true
		}
	}
	return out
}

// slotOf returns the slot relay owner runs in now, or -1.
func (f *fleet) slotOf(owner string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, r := range f.slots {
		if r.owner == owner && !r.paused {
			return i
		}
	}
	return -1
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

// finalLine is what relayproc prints after its drain.
type finalLine struct {
	goroutines, maxGoroutines int
	heapInuse, heapAlloc      uint64
}

var finalRE = regexp.MustCompile(`relayproc final: goroutines=(\d+) heap_inuse=(\d+) heap_alloc=(\d+) max_goroutines=(\d+)`)

func readFinal(path string) (finalLine, bool) {
	f, err := os.Open(path)
	if err != nil {
		return finalLine{}, false
	}
	defer f.Close()
	var out finalLine
	found := false
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		if m := finalRE.FindStringSubmatch(sc.Text()); m != nil {
			out.goroutines, _ = strconv.Atoi(m[1])
			out.heapInuse, _ = strconv.ParseUint(m[2], 10, 64)
			out.heapAlloc, _ = strconv.ParseUint(m[3], 10, 64)
			out.maxGoroutines, _ = strconv.Atoi(m[4])
			found = true
		}
	}
	return out, found
}

// stopAll asks every relay to stop (SIGTERM: drain and exit) and requires a
// clean exit (or, see diedBeforeMain, one that never started), and that no
// relay had exited on its own before: the relays live through every fault
// (a PostgreSQL restart included) without being restarted, unless the test
// killed them. It returns what each printed at exit.
func (f *fleet) stopAll() map[string]finalLine {
	f.mu.Lock()
	slots := append([]*relay(nil), f.slots...)
	all := append([]*relay(nil), f.all...)
	f.mu.Unlock()
	for _, r := range all {
		select {
		case <-r.exited:
			if !r.stopped {
				f.t.Errorf("relay %s exited on its own (%v) before the soak stopped it; log:\n%s", r.owner, r.err, tail(r.log))
			}
		default:
		}
	}
	for _, r := range slots {
		_ = r.cmd.Process.Signal(syscall.SIGCONT)
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
	}
	finals := map[string]finalLine{}
	for _, r := range slots {
		select {
		case <-r.exited:
			if r.err != nil && !diedBeforeMain(r.err) {
				f.t.Errorf("relay %s exited with %v; log:\n%s", r.owner, r.err, tail(r.log))
				continue
			}
			if r.err != nil {
				continue
			}
			fin, ok := readFinal(r.log)
			if !ok {
				f.t.Errorf("relay %s printed no final line at exit; log:\n%s", r.owner, tail(r.log))
				continue
			}
			finals[r.owner] = fin
		case <-time.After(30 * time.Second):
			f.t.Errorf("relay %s did not stop within 30s after SIGTERM; log:\n%s", r.owner, tail(r.log))
		}
	}
	return finals
}

// killAll SIGKILLs every relay that has not exited (the cleanup after a
// failure).
func (f *fleet) killAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.all {
		select {
		case <-r.exited:
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

func startProxy(t *testing.T, target string) *toxiproxy.Proxy {
	t.Helper()
	u, err := url.Parse(target)
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
	rng     *mrand.Rand
	fleet   *fleet
	proxy   *toxiproxy.Proxy
	db, ev  *sql.DB // outbox side, evidence side
	pools   []*sql.DB
	app     string
	budget  map[string]int
	cluster *testdb.Cluster

	// restartMu: a PostgreSQL restart holds it for writing; the operator
	// holds it for reading around each of its actions (a restart between
	// the statements of one action is not what this soak examines).
	restartMu sync.RWMutex

	mu       sync.Mutex
	counts   map[string]int
	pending  sync.WaitGroup // faults that heal themselves later
	cutting  bool
	latent   bool
	restarts []restartRecord
	due      []time.Duration // scheduled restarts, offsets into the window
	modes    []string
	hang     hangRecord
}

type restartRecord struct {
	mode              string
	down, recovered   time.Duration // stop to started again; started to every surviving relay beating again
	witnesses, beaten int           // relays alive across it; of those, beating again afterwards
}

type hangRecord struct {
	on           bool
	from, until  time.Time // the window (the evidence server's clock)
	termed       int
	termsWanted  int
	termsSkipped string
	extended     int // seconds added to the window while no relay had reported its claims paused
}

func (in *injector) faultCounts() map[string]int {
	in.mu.Lock()
	defer in.mu.Unlock()
	out := map[string]int{}
	for k, v := range in.counts {
		out[k] = v
	}
	return out
}

// scheduleRestarts picks the restart times from the seed: spread over the
// middle of the window, each fast or immediate, both modes when there are
// two or more.
func (in *injector) scheduleRestarts(cfg soakConfig) {
	first := in.rng.IntN(2)
	for k := range cfg.restarts {
		slot := cfg.window * 6 / 10 / time.Duration(cfg.restarts)
		at := cfg.window/5 + time.Duration(k)*slot + time.Duration(in.rng.Int64N(int64(slot/2)))
		in.due = append(in.due, at)
		in.modes = append(in.modes, []string{"fast", "immediate"}[(first+k)%2])
	}
}

func (in *injector) run(ctx context.Context, window time.Duration) {
	began := time.Now()
	deadline := began.Add(window)
	kinds := []string{"sigkill", "sigstop", "conn-cut", "conn-latency", "pg-terminate"}
	for time.Now().Before(deadline) {
		wait := time.NewTimer(time.Duration(500+in.rng.IntN(1500)) * time.Millisecond)
		select {
		case <-ctx.Done():
			wait.Stop()
			return
		case <-wait.C:
		}
		if len(in.due) > 0 && time.Since(began) >= in.due[0] {
			mode := in.modes[0]
			in.due, in.modes = in.due[1:], in.modes[1:]
			in.restart(mode)
			continue
		}
		kind := kinds[in.rng.IntN(len(kinds))]
		in.mu.Lock()
		spent := in.counts[kind] >= in.budget[kind]
		in.mu.Unlock()
		if spent {
			continue
		}
		if in.inject(kind) {
			in.mu.Lock()
			in.counts[kind]++
			in.mu.Unlock()
		}
	}
	for len(in.due) > 0 { // a restart scheduled late in a window cut short by a slow machine
		mode := in.modes[0]
		in.due, in.modes = in.due[1:], in.modes[1:]
		in.restart(mode)
	}
	in.pending.Wait()
}

// restart stops the outbox cluster (pg_ctl stop -m fast or immediate: a
// crash, recovered from the WAL at start), keeps it down for a moment, starts
// it again, and waits (for an event, with a generous deadline) until every
// relay that was running across it and still runs has renewed its
// heartbeat: the relays recover on their own, none is restarted.
func (in *injector) restart(mode string) {
	in.restartMu.Lock()
	defer in.restartMu.Unlock()
	t := in.fleet.t
	witnesses := in.fleet.live()
	began := time.Now()
	if err := in.cluster.Stop(mode, time.Minute); err != nil {
		t.Errorf("pg_ctl stop -m %s: %v", mode, err)
		return
	}
	down := time.NewTimer(time.Duration(300+in.rng.IntN(1200)) * time.Millisecond)
	<-down.C
	if err := in.cluster.Start(); err != nil {
		t.Errorf("pg_ctl start after stop -m %s: %v", mode, err)
		return
	}
	up := time.Now()
	// The test's own pools: their idle connections died with the server.
	for _, p := range in.pools {
		p.SetMaxIdleConns(0)
		p.SetMaxIdleConns(8)
	}
	rec := restartRecord{mode: mode, down: up.Sub(began), witnesses: len(witnesses)}
	deadline := time.Now().Add(90 * time.Second)
	for {
		alive := in.fleet.live()
		waiting := 0
		beaten := 0
		rows, err := in.db.Query(`SELECT owner FROM messaging_relay_heartbeat WHERE heartbeat_at > $1`, up)
		fresh := map[string]bool{}
		if err == nil {
			for rows.Next() {
				var o string
				if rows.Scan(&o) == nil {
					fresh[o] = true
				}
			}
			_ = rows.Close()
		}
		for o := range witnesses {
			switch {
			case fresh[o]:
				beaten++
			case alive[o]:
				waiting++
			}
		}
		if err == nil && waiting == 0 {
			rec.beaten = beaten
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("after the PostgreSQL restart (-m %s), %d relays running across it had not renewed their heartbeat within 90s (fresh: %v, witnesses: %v)", mode, waiting, fresh, witnesses)
			break
		}
		poll := time.NewTimer(100 * time.Millisecond)
		<-poll.C
	}
	rec.recovered = time.Since(up)
	in.mu.Lock()
	in.restarts = append(in.restarts, rec)
	in.counts["pg-restart-"+mode]++
	in.mu.Unlock()
}

// hangWindow turns on the downstream that hangs forever (every publish
// started while it is on blocks, ignoring its context, until it ends), and
// while it is on sends SIGTERM to relays that reported their claims paused
// (Report.ClaimPaused: more publishes left behind than MaxAbandoned): each
// must drain and exit cleanly although publishes still hang in it.
func (in *injector) hangWindow(ctx context.Context, cfg soakConfig) {
	t := in.fleet.t
	start := time.NewTimer(cfg.hangFrom)
	select {
	case <-ctx.Done():
		start.Stop()
		return
	case <-start.C:
	}
	var from, until time.Time
	err := in.ev.QueryRow(`UPDATE chaos_hang SET until = clock_timestamp() + $1 * interval '1 second'
		RETURNING clock_timestamp(), until`, cfg.hangFor.Seconds()).Scan(&from, &until)
	if err != nil {
		t.Errorf("start the hang window: %v", err)
		return
	}
	in.mu.Lock()
	in.hang = hangRecord{on: true, from: from, until: until, termsWanted: cfg.hangTerms}
	in.mu.Unlock()
	ends := time.NewTimer(cfg.hangFor)
	defer ends.Stop()
	termed := map[string]bool{}
	poll := time.NewTicker(100 * time.Millisecond)
	defer poll.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ends.C:
			// The window ends once it lasted hangFor and a relay reported
			// its claims paused in it (the verdict's evidence that the
			// relays bounded what they left behind). On a busy machine
			// that can take longer than hangFor: the window is then
			// extended a second at a time until it happens, within the
			// soak's own bound (ctx).
			var paused bool
			if err := in.ev.QueryRow(`SELECT EXISTS (SELECT 1 FROM chaos_gauge WHERE paused_passes > 0)`).Scan(&paused); err != nil {
				t.Errorf("read chaos_gauge: %v", err)
				return
			}
			if !paused {
				var until time.Time
				if err := in.ev.QueryRow(`UPDATE chaos_hang SET until = clock_timestamp() + interval '1 second' RETURNING until`).Scan(&until); err != nil {
					t.Errorf("extend the hang window: %v", err)
					return
				}
				in.mu.Lock()
				in.hang.until = until
				in.hang.extended++
				in.mu.Unlock()
				ends.Reset(time.Second)
				continue
			}
			in.mu.Lock()
			if in.hang.termed < cfg.hangTerms {
				in.hang.termsSkipped = fmt.Sprintf("%d of %d: no running relay reported its claims paused in time", cfg.hangTerms-in.hang.termed, cfg.hangTerms)
			}
			in.mu.Unlock()
			return
		case <-poll.C:
		}
		in.mu.Lock()
		done := in.hang.termed >= cfg.hangTerms
		in.mu.Unlock()
		if done {
			continue
		}
		// The event: a running relay says it stopped claiming.
		var owner string
		err := in.ev.QueryRow(`SELECT owner FROM chaos_gauge WHERE paused_passes > 0 AND owner = ANY($1::text[]) ORDER BY owner LIMIT 1`,
			ownersArray(in.fleet.live(), termed)).Scan(&owner)
		if errors.Is(err, sql.ErrNoRows) {
			continue
		}
		if err != nil {
			t.Errorf("read chaos_gauge: %v", err)
			return
		}
		i := in.fleet.slotOf(owner)
		if i < 0 {
			continue
		}
		termed[owner] = true
		// Not during a PostgreSQL restart: the drain writes its outcomes.
		in.restartMu.RLock()
		in.fleet.term(i)
		in.restartMu.RUnlock()
		in.mu.Lock()
		in.hang.termed++
		in.counts["sigterm-while-hanging"]++
		in.mu.Unlock()
	}
}

func ownersArray(live, exclude map[string]bool) any {
	var out []string
	for o := range live {
		if !exclude[o] {
			out = append(out, o)
		}
	}
	sort.Strings(out)
	return "{" + strings.Join(out, ",") + "}"
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
