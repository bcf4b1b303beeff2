// Chains across passes: which of this relay's chains were confirmed to
// their end, the continuations a claim made ahead may extend, and the keys
// a claim resumes instead of walking.

package forwarder

import (
	"slices"
	"sort"
	"sync"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// continuations are the chains of a batch that a claim made while the batch
// is in flight may extend: per key, the batch's last row of it, when every
// row of the key in the batch is held and readable.
func continuations(claimed []fencing.Claimed) []fencing.Continuation {
	var out []fencing.Continuation
	at := map[string]int{}
	for _, c := range claimed {
		k := c.Row.OrderingKey
		if k == "" {
			continue
		}
		i, seen := at[k]
		if !seen {
			i = len(out)
			at[k] = i
			out = append(out, fencing.Continuation{Key: k})
		}
		if out[i].AfterSeq == -1 {
			continue
		}
		if !c.Held() || c.Err != nil {
			out[i].AfterSeq = -1 // the chain ends here for good
			continue
		}
		out[i].AfterSeq, out[i].AfterID = c.Row.Seq, c.Row.MessageID
	}
	return slices.DeleteFunc(out, func(c fencing.Continuation) bool { return c.AfterSeq <= 0 })
}

// keysOf is the set of the keys cont continues (nil for none).
func keysOf(cont []fencing.Continuation) map[string]bool {
	if len(cont) == 0 {
		return nil
	}
	keys := make(map[string]bool, len(cont))
	for _, c := range cont {
		keys[c.Key] = true
	}
	return keys
}

// chainLog remembers, per ordering key, the row up to which this relay's
// last chain of the key was confirmed. It serves two purposes:
//
//   - a chain claimed ahead as a continuation goes out only behind a chain
//     that was confirmed to its end (confirmedThrough);
//   - a claim resumes the keys this relay published lately from where their
//     chains ended (positions), instead of looking for their heads.
//
// Looking for a key's head is what makes a claim expensive under write
// load: the ordering index keeps an entry for every row published since the
// last VACUUM, and while writers keep inserting into the same index pages
// PostgreSQL cannot mark those entries dead, so every head lookup visits the
// heap for each of them (measured: a claim that walked 100 keys took 100 ms
// behind 30,000 such entries, where resuming them takes a few). Entries
// older than chainWindow passes are dropped.
type chainLog struct {
	mu    sync.Mutex
	pass  int64
	until map[string]chainEnd
}

type chainEnd struct {
	seq  int64 // confirmed through this seq; 0: cut
	id   string
	pass int64
}

func (l *chainLog) record(key string, through int64, id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.until == nil {
		l.until = make(map[string]chainEnd)
	}
	l.until[key] = chainEnd{seq: through, id: id, pass: l.pass}
}

func (l *chainLog) confirmedThrough(key string, seq int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.until[key]
	return ok && e.seq == seq
}

// positions are continuations behind the last confirmed row of each key
// this relay published in its last chainWindow passes, at most limit of them
// (the most recent first), leaving out the keys of busy (a batch in
// flight: their chains are continued from the batch).
//
// A continuation takes the claimable rows right behind its row, which is
// published: so exactly the key's head and the rows behind it, unless a row
// of the key with a lower seq became claimable since (a transaction that
// committed after later rows of its key were published, or a redriven
// row). Such a row waits until a claim that does not resume keys walks
// them and reaches its key (claimer.claim: one claim in walkEvery, which
// walks from the key cursor like every walk).
func (l *chainLog) positions(busy []fencing.Continuation, limit int) []fencing.Continuation {
	l.mu.Lock()
	defer l.mu.Unlock()
	type pos struct {
		c    fencing.Continuation
		pass int64
	}
	var all []pos
	skip := keysOf(busy)
	for k, e := range l.until {
		if e.seq <= 0 || skip[k] {
			continue
		}
		all = append(all, pos{fencing.Continuation{Key: k, AfterSeq: e.seq, AfterID: e.id}, e.pass})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].pass > all[j].pass })
	out := make([]fencing.Continuation, 0, min(len(all), limit))
	for _, p := range all[:min(len(all), limit)] {
		out = append(out, p.c)
	}
	return out
}

// forget drops the chains of the keys of items whose outcomes were not
// written (or were stale): no claim may resume those keys behind a row that
// is not PUBLISHED, nor a continuation of them go out.
func (l *chainLog) forget(items []*item) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, it := range items {
		if k := it.claimed.Row.OrderingKey; k != "" {
			delete(l.until, k)
		}
	}
}

// chainWindow is how many passes a chain's position is kept for resuming
// its key: at most this many of a relay's batches can be unfinished
// (published, or having their outcomes written) when it starts a claim
// under prefetch and pipelining.
const chainWindow = 3

// endPass drops what no later claim can use.
func (l *chainLog) endPass() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.pass++
	for k, e := range l.until {
		if l.pass-e.pass > chainWindow {
			delete(l.until, k)
		}
	}
}
