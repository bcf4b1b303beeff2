package forwarder

import (
	"sync"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// rescanEvery is how many claims may start past the claimable index's first
// entry before one starts at it again (see claimStart).
const rescanEvery = 16

// claimStart chooses where each claim's index scan starts
// (fencing.ClaimParams.FromSeq).
//
// A drain leaves index entries at the head of the claimable index that no
// claim can take: those of the rows it published, until VACUUM removes them,
// and those of the rows in flight (this relay's batch being published, the
// one whose outcomes are being written, and other relays' batches). A claim
// that starts at the first entry visits every one of them (a heap fetch
// each): the longer the drain and the more relays, the slower every claim
// (a 100-row claim: 0.86 ms on a fresh index, 3.0 ms behind 290,000
// published rows). So while a relay is draining full batches, its claims
// start right after the last unkeyed row of its latest batch instead.
//
// Nothing is skipped for good. A claim that comes back short of a full
// batch from its start point claims the rest from the first entry at once
// (claimer.claim), so a short batch still means the whole index had no
// more; after it, after a failed claim, after a pass that gave rows back
// (released or unavailable: PENDING again, below the start point), and on
// every rescanEvery-th claim, claims start at the first entry again. While
// batches come back full, a claimable row below the start point waits, for
// rescanEvery claims at most: a row whose transaction committed after later
// rows had been drained, an AMBIGUOUS row whose retry came due, a row whose
// lease expired, a redriven row. The start point bounds only the unkeyed
// rows: keys are walked from their heads.
type claimStart struct {
	mu         sync.Mutex
	next       int64  // the seq after the latest full batch's last unkeyed row; 0: the first entry
	sinceFull  int    // claims since the last one that started at the first entry
	cursor     string // the key where the last walk over ordering keys stopped
	keyed      bool   // the last walk found keyed rows
	walkedOnce bool   // the first claim always walks
	sinceWalk  int    // claims since the last walk over keys
	// sinceFullWalk counts claims since the last that walked every key
	// rather than resuming recently published ones.
	sinceFullWalk int
}

// walkEvery is how many claims may skip the walk over ordering keys while
// the last walk found none (see claimer.claim): a key's first row waits
// for at most this many full batches of unkeyed rows.
const walkEvery = 8

// fullWalkDue reports whether the next claim walks every ordering key
// instead of resuming the keys the relay published lately (chainLog), and
// counts it: the first claim and every walkEvery-th one.
func (c *claimStart) fullWalkDue() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sinceFullWalk++
	if c.sinceFullWalk >= walkEvery {
		c.sinceFullWalk = 0
		return true
	}
	return false
}

// walkDue reports whether the next claim walks the ordering keys, and
// counts it.
func (c *claimStart) walkDue() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.walkedOnce || c.keyed || c.sinceWalk+1 >= walkEvery {
		c.walkedOnce = true
		c.sinceWalk = 0
		return true
	}
	c.sinceWalk++
	return false
}

// from returns the FromSeq for the next claim.
func (c *claimStart) from() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sinceFull >= rescanEvery {
		return 0
	}
	return c.next
}

// reset makes the next claim start at the first entry: rows were given
// back below the start point.
func (c *claimStart) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.next, c.sinceFull = 0, 0
}

// keyCursor is the KeyCursor for the next claim.
func (c *claimStart) keyCursor() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cursor
}

// walked records where a claim's walk over ordering keys stopped
// (fencing.NextKeyCursor), so the next walk starts after it and every key
// gets its turn, and whether it found keyed rows.
func (c *claimStart) walked(cursor string, keyed bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cursor, c.keyed, c.sinceWalk = cursor, keyed, 0
}

// record takes a claim whose unkeyed half started at from and asked for
// limit rows: its unkeyed rows are what counts (claimed is in seq order;
// keyed rows in it are skipped, not copied).
func (c *claimStart) record(from int64, limit int, claimed []fencing.Claimed, err error) {
	n, last := 0, int64(0)
	for _, r := range claimed {
		if r.Row.OrderingKey == "" {
			n, last = n+1, r.Row.Seq
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil || n < limit {
		c.next, c.sinceFull = 0, 0
		return
	}
	if from == 0 {
		c.sinceFull = 0
	} else {
		c.sinceFull++
	}
	c.next = last + 1
}
