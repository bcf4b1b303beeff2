package forwarder

import "time"

// SetDBTimeout shortens the bound of the forwarder's own statements, so a
// test can make a pass publish for longer than it without waiting 15 s.
// Call it before Run or RunOnce.
func SetDBTimeout(f *Forwarder, d time.Duration) { f.dbTimeout = d }
