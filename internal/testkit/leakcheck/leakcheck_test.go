package leakcheck

import (
	"strings"
	"testing"
	"time"
)

func blockedOn(ch chan struct{}) { <-ch }

func TestFindReportsARunningGoroutineUntilItExits(t *testing.T) {
	old := Timeout
	Timeout = 50 * time.Millisecond
	defer func() { Timeout = old }()

	release, exited := make(chan struct{}), make(chan struct{})
	go func() { defer close(exited); blockedOn(release) }()
	got := Find()
	if !strings.Contains(got, "leakcheck.blockedOn") {
		t.Fatalf("the blocked goroutine is not reported:\n%s", got)
	}
	if got := Find(IgnoreTopFunction("github.com/fencedoutbox/watermill-outbox/internal/testkit/leakcheck.blockedOn")); strings.Contains(got, "blockedOn") {
		t.Fatalf("an ignored top function is reported:\n%s", got)
	}
	close(release)
	<-exited
	Timeout = 5 * time.Second
	if got := Find(); got != "" {
		t.Fatalf("leaks reported once the goroutine exited:\n%s", got)
	}
}
