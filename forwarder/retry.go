// Retry policy: the backoff of AMBIGUOUS rows (stored in the row as
// next_attempt_at) and the loop's own backoff, both jittered by owner.

package forwarder

import (
	"hash/fnv"
	"math"
	"strconv"
	"time"
)

// RetryDelay is the wait before attempt+1 of a row whose attempt-th attempt
// was ambiguous: BackoffBase x 2^(attempt-1), capped at BackoffMax, with
// "equal jitter" (between half and all of it). The jitter is a hash of this
// relay's owner, the message id and the attempt: replicas spread their
// retries differently, and a given owner always computes the same delay.
func (f *Forwarder) RetryDelay(messageID string, attempt int) time.Duration {
	return f.env.retryDelay(messageID, attempt)
}

func (e *env) retryDelay(messageID string, attempt int) time.Duration {
	h := fnv.New64a()
	_, _ = h.Write([]byte(e.cfg.Owner))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(messageID))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(strconv.Itoa(attempt)))
	return spread(exp(e.cfg.BackoffBase, e.cfg.BackoffMax, attempt), h.Sum64())
}

// jittered is the loop's own backoff (idle passes, failing passes), seeded
// by the owner so replicas do not poll in lockstep.
func (e *env) jittered(base, ceiling time.Duration, n int, salt uint64) time.Duration {
	x := e.seed ^ (uint64(n) * 0x9E3779B97F4A7C15) ^ (salt << 32)
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	return spread(exp(base, ceiling, n), x)
}

func seedOf(owner string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(owner))
	return h.Sum64()
}

func exp(base, ceiling time.Duration, n int) time.Duration {
	if n < 1 {
		n = 1
	}
	d := float64(base) * math.Pow(2, float64(n-1))
	if d > float64(ceiling) || math.IsInf(d, 0) {
		return ceiling
	}
	return time.Duration(d)
}

func spread(d time.Duration, h uint64) time.Duration {
	frac := float64(h>>11) / float64(1<<53)
	return d/2 + time.Duration(frac*float64(d/2))
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
