package forwarder

import (
	"sync"
	"time"
)

// paces times publishes, over every destination and per destination, for
// the claim's sizes (nextSize, chainMax). The mean over every publish sizes
// the batch, whose rows go out Concurrency at a time; the slowest
// destination lately sizes one key's chain, which goes out one message at
// a time and may be all on that destination.
type paces struct {
	mu      sync.Mutex
	total   destPace
	by      map[string]*destPace
	spilled bool // a destination past maxPacedDestinations was published to since the last take
}

type destPace struct {
	nanos, count int64
	mean         time.Duration // over the publishes between the last two takes that had any
	idle         int           // takes since the last publish
}

const (
	// maxPacedDestinations bounds the per-destination table; publishes to
	// further destinations count in the mean only, and the chain is then
	// sized at no less than the mean.
	maxPacedDestinations = 256
	// paceForgetAfter is how many claims a destination's pace outlives its
	// last publish.
	paceForgetAfter = 64
)

// add counts one publish to dest that took took.
func (p *paces) add(dest string, took time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.total.nanos += int64(took)
	p.total.count++
	d := p.by[dest]
	if d == nil {
		if len(p.by) >= maxPacedDestinations {
			p.spilled = true
			return
		}
		if p.by == nil {
			p.by = make(map[string]*destPace)
		}
		d = &destPace{}
		p.by[dest] = d
	}
	d.nanos += int64(took)
	d.count++
}

// take ends an interval (one claim): it returns the mean publish time over
// the interval's publishes (0 when there were none) and the slowest
// destination's mean publish time as last measured, for the destinations
// published to in the last paceForgetAfter intervals (0 when none).
func (p *paces) take() (mean, slowest time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.total.count > 0 {
		mean = time.Duration(p.total.nanos / p.total.count)
	}
	p.total = destPace{}
	for dest, d := range p.by {
		if d.count > 0 {
			d.mean, d.nanos, d.count, d.idle = time.Duration(d.nanos/d.count), 0, 0, 0
		} else if d.idle++; d.idle > paceForgetAfter {
			delete(p.by, dest)
			continue
		}
		slowest = max(slowest, d.mean)
	}
	if p.spilled {
		slowest, p.spilled = max(slowest, mean), false
	}
	return mean, slowest
}
