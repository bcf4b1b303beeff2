package console

import (
	"context"
	"database/sql"
	"net/http"
	"sync"
	"time"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/status"
)

// overviewFigures is what the overview shows, read in one go in a person's
// name: the status snapshot (backlog groups, failure codes, relays) and the
// per-minute counts of the last hour.
type overviewFigures struct {
	snap      status.Snapshot
	delivered map[time.Time]int64
	parked    map[time.Time]int64
}

// overviewCache holds a person's latest overview figures. The backlog
// aggregates read every unpublished row (150,000 rows take about half a
// second of a loaded 2-core machine, docs/CONSOLE.md), so a page request
// answers from the figures it has and, when they are older than
// Config.OverviewMaxAge, refreshes them in the background (one refresh at a
// time): an idle console reads nothing, a watched one at most once per
// OverviewMaxAge. The page shows their age.
type overviewCache struct {
	mu      sync.Mutex
	figs    *overviewFigures
	at      time.Time     // console clock when figs were read
	pending chan struct{} // closed when the refresh in flight ends; nil when none
	last    chan struct{} // the latest refresh's (closed once it ended; tests wait on it)
}

func readOverview(ctx context.Context, db *sql.DB) (*overviewFigures, error) {
	snap, err := status.CollectWith(ctx, db, status.Options{MaxGroups: 10000, MaxFailureCodes: 20, MaxStuck: 1})
	if err != nil {
		return nil, err
	}
	since := snap.At.UTC().Truncate(time.Minute).Add(-(chartMinutes - 1) * time.Minute)
	f := &overviewFigures{snap: snap}
	if f.delivered, err = perMinute(ctx, db, deliveredPerMinuteQuery, since); err != nil {
		return nil, err
	}
	if f.parked, err = perMinute(ctx, db, parkedPerMinuteQuery, since); err != nil {
		return nil, err
	}
	return f, nil
}

// figures returns v's overview figures and when they were read: fresh ones
// (read now) when there are none yet or fresh is asked for, else the latest,
// starting a background refresh when they are older than the maximum age.
func (s *Server) figures(ctx context.Context, v *viewer, fresh bool) (*overviewFigures, time.Time, error) {
	c := v.ov
	c.mu.Lock()
	figs, at := c.figs, c.at
	if figs != nil && !fresh {
		if s.cfg.Now().Sub(at) >= s.cfg.OverviewMaxAge && c.pending == nil {
			s.mu.Lock()
			closed := s.closed
			if !closed {
				s.wg.Add(1)
			}
			s.mu.Unlock()
			if !closed {
				c.pending = make(chan struct{})
				c.last = c.pending
				go s.refresh(c, v.db)
			}
		}
		c.mu.Unlock()
		return figs, at, nil
	}
	c.mu.Unlock()
	figs, err := readOverview(ctx, v.db)
	if err != nil {
		return nil, time.Time{}, err
	}
	at = s.cfg.Now()
	c.mu.Lock()
	if !at.Before(c.at) {
		c.figs, c.at = figs, at
	}
	c.mu.Unlock()
	return figs, at, nil
}

// refresh reads the figures in the background; it stops when the console
// closes, and a failure (a pool closed at sign-out) keeps the old figures.
func (s *Server) refresh(c *overviewCache, db *sql.DB) {
	defer s.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-s.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	figs, err := readOverview(ctx, db)
	at := s.cfg.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil && !at.Before(c.at) {
		c.figs, c.at = figs, at
	}
	close(c.pending)
	c.pending = nil
}

type overviewData struct {
	Snap        status.Snapshot
	ParkedCodes []status.FailureCode
	Delivered   chart
	Parked      chart
	Oldest      string
	AsOf        time.Time
	Age         string
	MaxAge      string
}

// chartMinutes is the span of the overview's charts.
const chartMinutes = 60

func (s *Server) overview(w http.ResponseWriter, r *http.Request, v *viewer) error {
	figs, at, err := s.figures(r.Context(), v, r.URL.Query().Get("fresh") == "1")
	if err != nil {
		return err
	}
	snap := figs.snap
	d := overviewData{Snap: snap, Oldest: "-", AsOf: snap.At, MaxAge: s.cfg.OverviewMaxAge.String(),
		Age: s.cfg.Now().Sub(at).Round(time.Second).String()}
	if !snap.OldestPendingAt.IsZero() {
		d.Oldest = (time.Duration(snap.OldestPendingAgeSeconds * float64(time.Second))).Round(time.Second).String()
	}
	for _, f := range snap.FailureCodes {
		if f.Status == envelope.StatusFailed || f.Status == envelope.StatusExhausted {
			d.ParkedCodes = append(d.ParkedCodes, f)
		}
	}
	d.Delivered = minuteChart("Delivered per minute", snap.At, chartMinutes, figs.delivered)
	d.Parked = minuteChart("Parked per minute (still parked)", snap.At, chartMinutes, figs.parked)
	pd := v.data("Overview", "overview")
	pd.Data = d
	s.render(w, http.StatusOK, "overview", pd)
	return nil
}
