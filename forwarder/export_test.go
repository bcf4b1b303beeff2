package forwarder

import (
	"time"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// SetDBTimeout shortens the bound of the forwarder's own statements, so a
// test can make a pass publish for longer than it without waiting 15 s.
// Call it before Run or RunOnce.
func SetDBTimeout(f *Forwarder, d time.Duration) { f.dbTimeout = d }

// WrapStatements puts wrap around the connection the forwarder runs its
// claims and outcome writes on, so a test can fail them after they reached
// the database. Call it before Run or RunOnce.
func WrapStatements(f *Forwarder, wrap func(fencing.DBTX) fencing.DBTX) { f.q = wrap(f.q) }

// SetPinShareWait sets how long f's claims and outcome writes wait for the
// pinned connection while the other uses it (pinShareWait).
func SetPinShareWait(f *Forwarder, d time.Duration) { f.claimConn.shareWait = d }

// LanesOwned counts the lanes owner holds under a live lease (lanesOwned).
var LanesOwned = lanesOwned
