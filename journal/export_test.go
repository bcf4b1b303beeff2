package journal

// SetAfterRead installs a hook Begin calls between reading a conflicting row
// and its conditional takeover UPDATE.
func SetAfterRead(j *Journal, f func()) { j.afterRead = f }
