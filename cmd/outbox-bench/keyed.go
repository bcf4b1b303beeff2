package main

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// keyedBy is the ordering key of row g in a backlog of keys interleaved
// keys: 'k' || g % keys, so consecutive rows belong to different keys (as
// real traffic is) and every key's rows are spread over the whole backlog.
func keyedBy(keys int) string { return fmt.Sprintf("'k' || (g %% %d)", keys) }

// mixedKeys is prefillRows' key expression for the mixed backlog (drain
// cells whose name ends in "-mix"), the traffic of a service that orders
// some of its messages: per 10 rows in seq order, 2 on one of 3 hot keys, 3
// on one of 4,999 small keys (3 rows each in a 50,000-row backlog), 5
// without a key.
const mixedKeys = `CASE WHEN g % 10 < 2 THEN 'hot' || (g % 3) WHEN g % 10 < 5 THEN 'k' || (g % 4999) END`

// unkeyed is prefillRows' key expression for rows without an ordering key.
const unkeyed = "NULL"

// prefillRows writes n PENDING rows message_id prefix||g (g = 1..n, in seq
// order) with ordering key keyExpr (an SQL expression of g written by this
// program, never input), generated on the server in prefillChunk rows per
// transaction; extra, when set, is "columns|values" for more columns (a
// parked state, say). ANALYZE follows.
func prefillRows(ctx context.Context, db *sql.DB, prefix string, n int, payload []byte, keyExpr, extra string) error {
	cols, vals := "", ""
	if extra != "" {
		c, v, _ := strings.Cut(extra, "|")
		cols, vals = ", "+c, ", "+v
	}
	q := `INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key` + cols + `)
SELECT $1::text || g, $2::text, $3::bytea, ` + keyExpr + vals + ` FROM generate_series($4::int, $5::int) g`
	for lo := 1; lo <= n; lo += prefillChunk {
		hi := min(lo+prefillChunk-1, n)
		if _, err := db.ExecContext(ctx, q, prefix, benchTopic, payload, lo, hi); err != nil {
			return fmt.Errorf("prefill: %w", err)
		}
	}
	_, err := db.ExecContext(ctx, "ANALYZE")
	return err
}

// orderCheck is a downstream decorator that checks per-key order where it
// can be checked: at Publish, synchronously, before the message is handed
// to the GoChannel (which delivers on goroutines of its own and so reorders
// by itself). Message ids are prefix||g with g increasing in seq order
// within every key (prefillRows), so a key's first deliveries must come
// with increasing g. A message published again (a redelivery) is not a
// first delivery and is not judged. The first violation is kept.
type orderCheck struct {
	next   message.Publisher
	prefix string

	mu    sync.Mutex
	last  map[string]int // key -> g of its last first delivery
	seen  []bool         // g -> published at least once
	first int
	// unkeyedToo: the backlog has rows without a key (mixedKeys), which are
	// counted and not judged.
	unkeyedToo bool
	err        error
}

func newOrderCheck(next message.Publisher, prefix string, n int) *orderCheck {
	return &orderCheck{next: next, prefix: prefix, last: map[string]int{}, seen: make([]bool, n+1)}
}

func (o *orderCheck) Publish(topic string, msgs ...*message.Message) error {
	o.mu.Lock()
	for _, m := range msgs {
		o.judge(m)
	}
	o.mu.Unlock()
	return o.next.Publish(topic, msgs...)
}

func (o *orderCheck) judge(m *message.Message) {
	g, err := strconv.Atoi(strings.TrimPrefix(m.UUID, o.prefix))
	if err != nil || g <= 0 || g >= len(o.seen) {
		o.fail(fmt.Errorf("message %q is not one of the backlog's", m.UUID))
		return
	}
	key := m.Metadata.Get(envelope.KeyOrderingKey)
	if key == "" && !o.unkeyedToo {
		o.fail(fmt.Errorf("message %s arrived without its ordering key", m.UUID))
		return
	}
	if o.seen[g] {
		return
	}
	o.seen[g] = true
	o.first++
	if key == "" {
		return // no order to keep
	}
	if prev, ok := o.last[key]; ok && prev > g {
		o.fail(fmt.Errorf("key %s: %s%d published after %s%d, which is later in seq", key, o.prefix, g, o.prefix, prev))
	}
	o.last[key] = max(o.last[key], g)
}

func (o *orderCheck) fail(err error) {
	if o.err == nil {
		o.err = err
	}
}

func (o *orderCheck) Close() error { return nil }

// violation is the first order violation seen, if any.
func (o *orderCheck) violation() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// firstDeliveries is the number of distinct messages published.
func (o *orderCheck) firstDeliveries() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.first
}

// processCPU is this process's CPU time so far (getrusage RUSAGE_SELF,
// user + system). Every relay of the benchmark runs in this process, and so
// does the GoChannel's consumer; a drain cell's delta therefore includes the
// consumer's share, the same per message in every cell, which cancels in the
// comparison between relays.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
