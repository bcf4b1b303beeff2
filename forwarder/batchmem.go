package forwarder

import "github.com/fencedoutbox/watermill-outbox/fencing"

// batchMem is the working memory of one batch, kept from a pass for a
// later one (claimer.mem). Per row it is most of what the relay itself
// allocates: the claimed row (its 35 columns, about 800 bytes), its item
// and its outcome. At BatchSize 100 and beyond these are large allocations,
// which the Go runtime takes from the page heap and, once free, returns to
// the OS in the background; allocated afresh for every pass they cost the
// relay more CPU in the garbage collector and the scavenger than in its
// own code (a CPU profile of a 100-row drain: madvise alone 13% of the
// process).
//
// A batchMem is taken by the claim and given back by the pass once its
// outcomes are written. Nothing of a batch is used after that: a publish
// left running in a hanging downstream holds its message, not the batch,
// and touches nothing of the pass when it returns (see workers).
//
// The forwarder keeps up to keptBatches of them (claimer.mem), not in a
// sync.Pool: a pool is emptied by every other garbage collection, and a
// draining relay collects many times per pass, so a pooled batch was
// mostly gone by the next claim (an allocation profile of a 1,000-row
// drain: a fresh claim buffer per claim). What stays allocated is bounded:
// keptBatches batches of at most MaxBatchSize rows (about 2 MB at the
// defaults), for as long as the forwarder lives.
type batchMem struct {
	claimed  []fencing.Claimed
	items    []item
	ptrs     []*item // &items[i]: an unkeyed row's unit is ptrs[i : i+1]
	units    []unit
	outcomes []fencing.Outcome
	written  []*item
	// keep is false once a publish of the batch was left running: the
	// memory then goes to the garbage collector, not to another batch.
	keep bool
}

// keptBatches is how many batches' memory the forwarder keeps: the batch
// in flight, the one claimed ahead, and one being given back.
const keptBatches = 3

func (cl *claimer) takeMem() *batchMem {
	select {
	case m := <-cl.mem:
		return m
	default:
		return &batchMem{keep: true}
	}
}

// giveMem keeps m for a later batch, emptied first: a kept batch pins no
// payloads, messages or errors.
func (cl *claimer) giveMem(m *batchMem) {
	if m == nil || !m.keep {
		return
	}
	clear(m.claimed)
	clear(m.items)
	clear(m.ptrs)
	clear(m.units)
	clear(m.outcomes)
	clear(m.written)
	m.claimed, m.items, m.ptrs, m.units = m.claimed[:0], m.items[:0], m.ptrs[:0], m.units[:0]
	m.outcomes, m.written = m.outcomes[:0], m.written[:0]
	select {
	case cl.mem <- m:
	default: // keptBatches are kept already
	}
}

// itemsFor returns n zeroed items and their pointers, for the rows of
// m.claimed.
func (m *batchMem) itemsFor(n int) ([]item, []*item) {
	if cap(m.items) < n {
		m.items, m.ptrs = make([]item, n), make([]*item, n)
	}
	m.items, m.ptrs = m.items[:n], m.ptrs[:n]
	for i := range m.items {
		m.ptrs[i] = &m.items[i]
	}
	return m.items, m.ptrs
}
