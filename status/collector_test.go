package status

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// fakeClock is a clock the test steps by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) Add(d time.Duration) { c.mu.Lock(); c.now = c.now.Add(d); c.mu.Unlock() }

const backlogExpected = `
# HELP outbox_backlog_messages Outbox rows not yet PUBLISHED, by status and destination (destinations beyond the cap summed under _other).
# TYPE outbox_backlog_messages gauge
outbox_backlog_messages{destination="billing",status="AMBIGUOUS"} 1
outbox_backlog_messages{destination="billing",status="EXHAUSTED"} 1
outbox_backlog_messages{destination="billing",status="FAILED"} 0
outbox_backlog_messages{destination="billing",status="IN_FLIGHT"} 0
outbox_backlog_messages{destination="billing",status="PENDING"} 1
outbox_backlog_messages{destination="orders",status="AMBIGUOUS"} 0
outbox_backlog_messages{destination="orders",status="EXHAUSTED"} 0
outbox_backlog_messages{destination="orders",status="FAILED"} 2
outbox_backlog_messages{destination="orders",status="IN_FLIGHT"} 1
outbox_backlog_messages{destination="orders",status="PENDING"} 2
# HELP outbox_parked_messages Rows parked for an operator (FAILED rejected, EXHAUSTED out of attempts).
# TYPE outbox_parked_messages gauge
outbox_parked_messages{status="EXHAUSTED"} 1
outbox_parked_messages{status="FAILED"} 2
`

func TestCollectorExposesBacklogFromRealRows(t *testing.T) {
	t.Parallel()
	s := fixture(t)
	clock := &fakeClock{now: t0}
	c, err := NewCollector(s.DB, CollectorOptions{Interval: time.Minute, Clock: clock.Now})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(backlogExpected),
		"outbox_backlog_messages", "outbox_parked_messages"))
	// The oldest pending row (AMBIGUOUS, created 3h before t0) is aged by the
	// database clock, which runs years before t0 here: the gauge is >= 0 and
	// finite; the SQL's age arithmetic is pinned in TestCollectorOldestAge.
	n, err := testutil.GatherAndCount(reg, "outbox_oldest_pending_age_seconds", "outbox_backlog_sample_errors_total", "outbox_backlog_sample_age_seconds")
	require.NoError(t, err)
	require.Equal(t, 3, n)

	// Within the interval, new rows are not seen: scrapes read the cache.
	insert(t, s.DB, seed{id: "late", dest: "orders", status: "FAILED", age: time.Second})
	clock.Add(59 * time.Second)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(backlogExpected),
		"outbox_backlog_messages", "outbox_parked_messages"))

	// Past it, the next scrape samples again.
	clock.Add(time.Second)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP outbox_parked_messages Rows parked for an operator (FAILED rejected, EXHAUSTED out of attempts).
# TYPE outbox_parked_messages gauge
outbox_parked_messages{status="EXHAUSTED"} 1
outbox_parked_messages{status="FAILED"} 3
`), "outbox_parked_messages"))
}

func TestCollectorOldestAge(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	// Created one hour before the database's now(): the gauge reads about 3600.
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "old", Destination: "d", Payload: []byte("x")},
		testdb.SQL("created_at", "now() - interval '1 hour'"))
	c, err := NewCollector(s.DB, CollectorOptions{})
	require.NoError(t, err)
	age := testutil.ToFloat64(prometheus.CollectorFunc(func(ch chan<- prometheus.Metric) {
		all := make(chan prometheus.Metric, 32)
		c.Collect(all)
		close(all)
		for m := range all {
			if strings.Contains(m.Desc().String(), "oldest_pending_age_seconds") {
				ch <- m
			}
		}
	}))
	require.InDelta(t, 3600, age, 60)
}

func TestCollectorCapsDestinations(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	insert(t, s.DB,
		seed{id: "1", dest: "big", status: "PENDING"}, seed{id: "2", dest: "big", status: "PENDING"},
		seed{id: "3", dest: "big", status: "FAILED"},
		seed{id: "4", dest: "small-a", status: "PENDING"}, seed{id: "5", dest: "small-b", status: "EXHAUSTED"},
	)
	c, err := NewCollector(s.DB, CollectorOptions{MaxDestinations: 1})
	require.NoError(t, err)
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(`
# HELP outbox_backlog_messages Outbox rows not yet PUBLISHED, by status and destination (destinations beyond the cap summed under _other).
# TYPE outbox_backlog_messages gauge
outbox_backlog_messages{destination="_other",status="AMBIGUOUS"} 0
outbox_backlog_messages{destination="_other",status="EXHAUSTED"} 1
outbox_backlog_messages{destination="_other",status="FAILED"} 0
outbox_backlog_messages{destination="_other",status="IN_FLIGHT"} 0
outbox_backlog_messages{destination="_other",status="PENDING"} 1
outbox_backlog_messages{destination="big",status="AMBIGUOUS"} 0
outbox_backlog_messages{destination="big",status="EXHAUSTED"} 0
outbox_backlog_messages{destination="big",status="FAILED"} 1
outbox_backlog_messages{destination="big",status="IN_FLIGHT"} 0
outbox_backlog_messages{destination="big",status="PENDING"} 2
`), "outbox_backlog_messages"))
}

func TestCollectorServesLastSampleWhenTheDatabaseFails(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	db := s.Open(t)
	db.SetMaxOpenConns(2)
	insert(t, db, seed{id: "1", dest: "d", status: "FAILED"})
	clock := &fakeClock{now: t0}
	c, err := NewCollector(db, CollectorOptions{Interval: time.Second, Clock: clock.Now})
	require.NoError(t, err)
	parked := `
# HELP outbox_backlog_sample_errors_total Backlog samples that failed; the previous sample was served instead.
# TYPE outbox_backlog_sample_errors_total counter
outbox_backlog_sample_errors_total %s
# HELP outbox_parked_messages Rows parked for an operator (FAILED rejected, EXHAUSTED out of attempts).
# TYPE outbox_parked_messages gauge
outbox_parked_messages{status="EXHAUSTED"} 0
outbox_parked_messages{status="FAILED"} 1
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(strings.Replace(parked, "%s", "0", 1)),
		"outbox_parked_messages", "outbox_backlog_sample_errors_total"))
	require.NoError(t, db.Close()) // the database goes away
	clock.Add(time.Minute)
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(strings.Replace(parked, "%s", "1", 1)),
		"outbox_parked_messages", "outbox_backlog_sample_errors_total"))
}

func TestNewCollectorRefusesBadOptions(t *testing.T) {
	t.Parallel()
	_, err := NewCollector(nil, CollectorOptions{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	s := testdb.New(t)
	for _, o := range []CollectorOptions{{Interval: -1}, {Timeout: -1}, {MaxDestinations: -1}, {MaxGroups: -1}} {
		_, err := NewCollector(s.DB, o)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%+v", o)
	}
}

// ConstLabels are on every series the collector exposes; a label name
// Prometheus refuses, one of the collector's own labels, or a value that is
// not UTF-8 is refused when the collector is built, with a code, not at the
// caller's Register.
func TestCollectorConstLabels(t *testing.T) {
	t.Parallel()
	s := fixture(t)
	c, err := NewCollector(s.DB, CollectorOptions{ConstLabels: prometheus.Labels{"deployment": "blue"}})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	families, err := reg.Gather()
	require.NoError(t, err)
	series := 0
	for _, mf := range families {
		for _, m := range mf.GetMetric() {
			series++
			found := false
			for _, l := range m.GetLabel() {
				found = found || (l.GetName() == "deployment" && l.GetValue() == "blue")
			}
			require.True(t, found, "%s%v has no deployment label", mf.GetName(), m.GetLabel())
		}
	}
	require.Greater(t, series, 10, "the fixture's backlog is exposed")

	for _, bad := range []prometheus.Labels{
		{"status": "x"}, {"destination": "x"}, {"slot": "x"}, {"wal_status": "x"},
		{"__reserved": "x"}, {"": "x"}, {"deployment": "\xff"},
	} {
		_, err := NewCollector(s.DB, CollectorOptions{ConstLabels: bad})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%q", bad)
	}
}

// More (status, destination) groups than MaxGroups: the groups cut by the
// query's bound are still counted (under _other), and the parked counts and
// the oldest pending age come from exact per-status totals.
func TestCollectorCountsGroupsBeyondMaxGroups(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	insert(t, s.DB,
		seed{id: "a1", dest: "a", status: "PENDING", age: time.Minute},
		seed{id: "a2", dest: "a", status: "PENDING", age: time.Minute},
		seed{id: "a3", dest: "a", status: "PENDING", age: time.Minute},
		seed{id: "b1", dest: "b", status: "PENDING", age: time.Minute},
		seed{id: "b2", dest: "b", status: "PENDING", age: time.Minute},
		seed{id: "c1", dest: "c", status: "PENDING", age: 2 * time.Hour},
		seed{id: "f1", dest: "d", status: "FAILED", age: time.Minute},
	)
	// Ages against the database's clock (the collector's): c1 is the oldest.
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET created_at = now() - CASE WHEN message_id = 'c1' THEN interval '2 hours' ELSE interval '1 minute' END`)
	require.NoError(t, err)
	c, err := NewCollector(s.DB, CollectorOptions{Interval: time.Minute, MaxGroups: 2, MaxDestinations: 1})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	pending, parked := 0.0, 0.0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch {
			case mf.GetName() == "outbox_backlog_messages" && labels["status"] == "PENDING":
				pending += m.GetGauge().GetValue()
			case mf.GetName() == "outbox_parked_messages" && labels["status"] == "FAILED":
				parked += m.GetGauge().GetValue()
			}
		}
	}
	require.Equal(t, 6.0, pending, "every PENDING row counted, the cut groups under _other")
	require.Equal(t, 1.0, parked, "the FAILED row's group was cut, its total was not")
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP outbox_backlog_messages Outbox rows not yet PUBLISHED, by status and destination (destinations beyond the cap summed under _other).
# TYPE outbox_backlog_messages gauge
outbox_backlog_messages{destination="_other",status="AMBIGUOUS"} 0
outbox_backlog_messages{destination="_other",status="EXHAUSTED"} 0
outbox_backlog_messages{destination="_other",status="FAILED"} 1
outbox_backlog_messages{destination="_other",status="IN_FLIGHT"} 0
outbox_backlog_messages{destination="_other",status="PENDING"} 3
outbox_backlog_messages{destination="a",status="AMBIGUOUS"} 0
outbox_backlog_messages{destination="a",status="EXHAUSTED"} 0
outbox_backlog_messages{destination="a",status="FAILED"} 0
outbox_backlog_messages{destination="a",status="IN_FLIGHT"} 0
outbox_backlog_messages{destination="a",status="PENDING"} 3
`), "outbox_backlog_messages"))
	// The oldest pending row (c1, 2h) was in a cut group; its age still counts.
	var age float64
	for _, mf := range mfs {
		if mf.GetName() == "outbox_oldest_pending_age_seconds" {
			age = mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	require.InDelta(t, 7200, age, 60)
}
