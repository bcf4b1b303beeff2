package status

import (
	"cmp"
	"context"
	"database/sql"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// OtherDestination is the destination label under which the collector folds
// the destinations beyond CollectorOptions.MaxDestinations.
const OtherDestination = "_other"

// CollectorOptions tune [NewCollector]. The zero value is valid.
type CollectorOptions struct {
	// Interval is how long one database sample serves scrapes. Scrapes
	// within it (however many, from however many scrapers) read the cached
	// sample; the first scrape after it queries again. Default 15s.
	Interval time.Duration
	// Timeout bounds one sample query. Default 5s.
	Timeout time.Duration
	// MaxDestinations caps the destination label values: the largest
	// destinations by backlog keep their own label, the rest are summed under
	// "_other". Default 50.
	MaxDestinations int
	// MaxGroups bounds the (status, destination) rows one sample reads,
	// largest first. Default 10000. Rows of groups beyond it are not lost:
	// the per-status totals are read exactly and the rest is counted under
	// "_other".
	MaxGroups int
	// Namespace prefixes the metric names. Default "outbox".
	Namespace string
	// ConstLabels are added to every series (for example the deployment or
	// the database). A label name Prometheus refuses, or one of the
	// collector's own labels (status, destination, slot, wal_status), is
	// refused by NewCollector with OUTBOX_INVALID_CONFIG.
	ConstLabels prometheus.Labels
	// Clock decides when the cache expires. Default time.Now. Tests pass a
	// fake clock to step past the interval without sleeping.
	Clock func() time.Time
}

func (o CollectorOptions) withDefaults() CollectorOptions {
	o.Interval = cmp.Or(o.Interval, 15*time.Second)
	o.Timeout = cmp.Or(o.Timeout, 5*time.Second)
	o.MaxDestinations = cmp.Or(o.MaxDestinations, 50)
	o.MaxGroups = cmp.Or(o.MaxGroups, 10000)
	o.Namespace = cmp.Or(o.Namespace, "outbox")
	if o.Clock == nil {
		o.Clock = time.Now
	}
	return o
}

// Validate refuses negative values.
func (o CollectorOptions) Validate() error {
	if o.Interval < 0 || o.Timeout < 0 || o.MaxDestinations < 0 || o.MaxGroups < 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, "status.CollectorOptions", "Interval, Timeout, MaxDestinations and MaxGroups must be >= 0 (0 = default)")
	}
	return nil
}

// backlogStatuses are the label values of outbox_backlog_messages: every
// status but PUBLISHED, which is history, not backlog.
var backlogStatuses = []envelope.Status{
	envelope.StatusPending, envelope.StatusInFlight, envelope.StatusAmbiguous,
	envelope.StatusFailed, envelope.StatusExhausted,
}

// Collector is a prometheus.Collector exposing the outbox backlog:
//
//	<ns>_backlog_messages{status,destination}   gauge, non-PUBLISHED rows
//	<ns>_oldest_pending_age_seconds             gauge, 0 when nothing is pending
//	<ns>_parked_messages{status}                gauge, FAILED and EXHAUSTED
//	<ns>_backlog_sample_errors_total            counter, failed samples
//	<ns>_backlog_sample_age_seconds             gauge, age of the sample served
//	<ns>_cdc_slot_retained_wal_bytes{slot}      gauge, WAL the slot keeps (restart_lsn to now)
//	<ns>_cdc_slot_confirmed_lag_bytes{slot}     gauge, WAL since the consumer's confirmed position
//	<ns>_cdc_slot_safe_wal_size_bytes{slot}     gauge, WAL left before the slot may be lost (absent without max_slot_wal_keep_size)
//	<ns>_cdc_slot_wal_status{slot,wal_status}   gauge, 1 for the slot's wal_status, 0 for the others
//	<ns>_cdc_slot_active{slot}                  gauge, 1 while a consumer streams the slot
//	<ns>_cdc_consumers                          gauge, CDC consumers with a live heartbeat
//	<ns>_cdc_consumer_slots                     gauge, distinct slots among them (above 1: double delivery)
//
// A failed sample does not fail the scrape: the last good sample is served
// (its age shows it) and the error counter grows.
type Collector struct {
	db   *sql.DB
	opts CollectorOptions

	backlog, oldest, parked, errs, sampleAge *prometheus.Desc

	slotRetained, slotLag, slotSafe, slotStatus, slotActive, consumers, consumerSlots *prometheus.Desc

	mu      sync.Mutex // serialises samples: a scrape storm waits for one query
	sample  sample
	taken   time.Time
	have    bool
	errorsN float64
}

type sample struct {
	backlog      map[[2]string]float64 // (status, destination) -> rows
	destinations []string
	oldestAge    float64
	parked       map[envelope.Status]float64
	slots        []Slot
	consumers    int
	consumerSlot int
}

// slotWALStatuses are the label values of <ns>_cdc_slot_wal_status, every
// one exposed (0 or 1) so an alert can match the value that is 1.
var slotWALStatuses = []string{"reserved", "extended", "unreserved", "lost"}

// NewCollector returns a Collector over db. Register it with a
// prometheus.Registerer; it queries only when scraped.
func NewCollector(db *sql.DB, opts CollectorOptions) (*Collector, error) {
	if db == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "status.NewCollector", "db is nil")
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	ns, cl := opts.Namespace, opts.ConstLabels
	c := &Collector{
		db:   db,
		opts: opts,
		backlog: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "backlog_messages"),
			"Outbox rows not yet PUBLISHED, by status and destination (destinations beyond the cap summed under _other).",
			[]string{"status", "destination"}, cl),
		oldest: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "oldest_pending_age_seconds"),
			"Age of the oldest PENDING, IN_FLIGHT or AMBIGUOUS row by the database clock; 0 when none.", nil, cl),
		parked: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "parked_messages"),
			"Rows parked for an operator (FAILED rejected, EXHAUSTED out of attempts).", []string{"status"}, cl),
		errs: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "backlog_sample_errors_total"),
			"Backlog samples that failed; the previous sample was served instead.", nil, cl),
		sampleAge: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "backlog_sample_age_seconds"),
			"Seconds since the backlog sample being served was read from the database.", nil, cl),
		slotRetained: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "cdc_slot_retained_wal_bytes"),
			"WAL a logical replication slot keeps from being recycled (server WAL position minus restart_lsn).", []string{"slot"}, cl),
		slotLag: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "cdc_slot_confirmed_lag_bytes"),
			"WAL written since the slot's consumer confirmed (server WAL position minus confirmed_flush_lsn).", []string{"slot"}, cl),
		slotSafe: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "cdc_slot_safe_wal_size_bytes"),
			"WAL that can still be written before the slot may be invalidated (pg_replication_slots.safe_wal_size); absent when max_slot_wal_keep_size is -1.", []string{"slot"}, cl),
		slotStatus: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "cdc_slot_wal_status"),
			"1 for the slot's wal_status (reserved, extended, unreserved, lost), 0 for the others.", []string{"slot", "wal_status"}, cl),
		slotActive: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "cdc_slot_active"),
			"1 while a consumer streams from the slot.", []string{"slot"}, cl),
		consumers: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "cdc_consumers"),
			"CDC consumers (native relays, Debezium connectors) with a live heartbeat.", nil, cl),
		consumerSlots: prometheus.NewDesc(prometheus.BuildFQName(ns, "", "cdc_consumer_slots"),
			"Distinct replication slots among the live CDC consumers; above 1 every insert is delivered more than once.", nil, cl),
	}
	// A descriptor keeps what is wrong with its labels until it is
	// registered: registering on a registry of its own (Describe only, no
	// query) reports it now, with a code, instead of at the caller's
	// Register.
	if err := prometheus.NewRegistry().Register(c); err != nil {
		return nil, outbox.Wrap(outbox.CodeInvalidConfig, "status.NewCollector", err, "ConstLabels")
	}
	return c, nil
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.backlog
	ch <- c.oldest
	ch <- c.parked
	ch <- c.errs
	ch <- c.sampleAge
	ch <- c.slotRetained
	ch <- c.slotLag
	ch <- c.slotSafe
	ch <- c.slotStatus
	ch <- c.slotActive
	ch <- c.consumers
	ch <- c.consumerSlots
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	now := c.opts.Clock()
	if !c.have || now.Sub(c.taken) >= c.opts.Interval {
		s, err := c.read()
		if err != nil {
			c.errorsN++
		} else {
			c.sample, c.taken, c.have = s, now, true
		}
	}
	s, taken, have, errorsN := c.sample, c.taken, c.have, c.errorsN
	c.mu.Unlock()

	ch <- prometheus.MustNewConstMetric(c.errs, prometheus.CounterValue, errorsN)
	if !have {
		return // never sampled successfully: expose nothing rather than zeros that look like an empty outbox
	}
	ch <- prometheus.MustNewConstMetric(c.sampleAge, prometheus.GaugeValue, max(0, now.Sub(taken).Seconds()))
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, s.oldestAge)
	for _, st := range []envelope.Status{envelope.StatusFailed, envelope.StatusExhausted} {
		ch <- prometheus.MustNewConstMetric(c.parked, prometheus.GaugeValue, s.parked[st], string(st))
	}
	ch <- prometheus.MustNewConstMetric(c.consumers, prometheus.GaugeValue, float64(s.consumers))
	ch <- prometheus.MustNewConstMetric(c.consumerSlots, prometheus.GaugeValue, float64(s.consumerSlot))
	for _, sl := range s.slots {
		ch <- prometheus.MustNewConstMetric(c.slotRetained, prometheus.GaugeValue, float64(sl.RetainedWALBytes), sl.Name)
		ch <- prometheus.MustNewConstMetric(c.slotLag, prometheus.GaugeValue, float64(sl.ConfirmedLagBytes), sl.Name)
		if sl.SafeWALSizeBytes != nil {
			ch <- prometheus.MustNewConstMetric(c.slotSafe, prometheus.GaugeValue, float64(*sl.SafeWALSizeBytes), sl.Name)
		}
		active := 0.0
		if sl.Active {
			active = 1
		}
		ch <- prometheus.MustNewConstMetric(c.slotActive, prometheus.GaugeValue, active, sl.Name)
		for _, ws := range slotWALStatuses {
			v := 0.0
			if ws == sl.WALStatus {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(c.slotStatus, prometheus.GaugeValue, v, sl.Name, ws)
		}
	}
	// Every status for each destination present, zeros included, so a
	// status that drains to nothing reads 0 instead of vanishing.
	for _, d := range s.destinations {
		for _, st := range backlogStatuses {
			ch <- prometheus.MustNewConstMetric(c.backlog, prometheus.GaugeValue, s.backlog[[2]string{string(st), d}], string(st), d)
		}
	}
}

func (c *Collector) read() (sample, error) {
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.Timeout)
	defer cancel()
	rows, err := c.db.QueryContext(ctx, backlogByDestinationQuery, c.opts.MaxGroups, nil)
	if err != nil {
		return sample{}, err
	}
	defer rows.Close()
	type group struct {
		status, dest string
		n, age       float64
	}
	var groups []group
	perDest := map[string]float64{}
	unplaced := map[string]float64{} // per status: the total, minus every group read
	s := sample{backlog: map[[2]string]float64{}, parked: map[envelope.Status]float64{}}
	for rows.Next() {
		var g group
		var dest sql.NullString
		if err := rows.Scan(&g.status, &dest, &g.n, &g.age); err != nil {
			return sample{}, err
		}
		if !dest.Valid { // the status's total: exact whatever the LIMIT cut
			unplaced[g.status] += g.n
			switch envelope.Status(g.status) {
			case envelope.StatusPending, envelope.StatusInFlight, envelope.StatusAmbiguous:
				s.oldestAge = max(s.oldestAge, g.age)
			case envelope.StatusFailed, envelope.StatusExhausted:
				s.parked[envelope.Status(g.status)] += g.n
			}
			continue
		}
		g.dest = dest.String
		unplaced[g.status] -= g.n
		groups = append(groups, g)
		perDest[g.dest] += g.n
	}
	if err := rows.Err(); err != nil {
		return sample{}, err
	}
	// Keep the largest destinations; fold the tail so label cardinality is
	// bounded whatever the number of topics.
	dests := make([]string, 0, len(perDest))
	for d := range perDest {
		dests = append(dests, d)
	}
	slices.SortFunc(dests, func(a, b string) int {
		return cmp.Or(cmp.Compare(perDest[b], perDest[a]), cmp.Compare(a, b))
	})
	kept := map[string]bool{}
	for i, d := range dests {
		if i < c.opts.MaxDestinations {
			kept[d] = true
		}
	}
	folded := false
	for _, g := range groups {
		d := g.dest
		if !kept[d] {
			d, folded = OtherDestination, true
		}
		s.backlog[[2]string{g.status, d}] += g.n
	}
	// Groups the query's LIMIT cut (more than MaxGroups of them) still count.
	for st, n := range unplaced {
		if n > 0 {
			s.backlog[[2]string{st, OtherDestination}] += n
			folded = true
		}
	}
	s.destinations = dests[:min(len(dests), c.opts.MaxDestinations)]
	slices.Sort(s.destinations)
	if folded {
		s.destinations = append(s.destinations, OtherDestination)
	}
	if s.slots, err = ReadSlots(ctx, c.db); err != nil {
		return sample{}, err
	}
	live, err := relaymode.LiveCDCConsumers(ctx, c.db, time.Time{})
	if err != nil {
		return sample{}, err
	}
	slotNames := map[string]bool{}
	for _, h := range live {
		slotNames[h.SlotName] = true
	}
	s.consumers, s.consumerSlot = len(live), len(slotNames)
	return s, nil
}
