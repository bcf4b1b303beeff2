package forwarder_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
)

func TestValidateRefusesAListenURLTheListenerCannotUse(t *testing.T) {
	for _, tc := range []struct{ name, url string }{
		{"pgxpool URL parameter", "postgres://app:s3cret@127.0.0.1:5432/test?pool_max_conns=5"},
		{"pgx key=value parameter", "host=127.0.0.1 user=app password=s3cret statement_cache_capacity=0"},
		{"pgx exec mode", "postgres://127.0.0.1/test?default_query_exec_mode=simple_protocol"},
		{"not a URL", "postgres://app:s3cret@[::1/test"},
		{"another scheme", "mysql://app:s3cret@127.0.0.1/test"},
		{"blank", "   "},
		{"bad key=value", "host=127.0.0.1 password='s3cret"},
		{"URL with a bad sslmode", "postgres://app:s3cret@127.0.0.1/test?sslmode=bogus"},
		{"URL with a bad connect_timeout", "postgres://app:s3cret@127.0.0.1/test?connect_timeout=abc"},
		{"pgx parameter with spaces", "host=127.0.0.1 password=s3cret pool_max_conns = 5"},
		{"missing service file", "host=127.0.0.1 password=s3cret service=nosuch servicefile=/nonexistent/pg_service.conf"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := forwarder.Config{ListenURL: tc.url}.Validate()
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			require.NotContains(t, err.Error(), "s3cret", "the refusal never quotes the password")
		})
	}
	for _, ok := range []string{
		"postgres://postgres@127.0.0.1:5432/test?sslmode=disable&search_path=x&application_name=relay",
		"host=127.0.0.1 user=postgres dbname=test sslmode=disable",
		// lib/pq understands these (they were once refused as pgx's only).
		"postgres://postgres@127.0.0.1:5432,127.0.0.1:5433/test?sslmode=disable&target_session_attrs=read-write",
		"host = 127.0.0.1 user = postgres dbname=test sslmode=disable target_session_attrs=any",
	} {
		require.NoError(t, forwarder.Config{ListenURL: ok}.Validate(), ok)
	}
	err := forwarder.Config{ListenURL: "postgres://127.0.0.1/test", Listener: forwarder.PQListener{URL: "postgres://127.0.0.1/test"}}.Validate()
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, "ListenURL and Listener together are ambiguous")
}

// chanListener is a Listener driven by the test: every send on notify is a
// notification; problems it is told to report go to the logger.
type chanListener struct {
	notify  chan struct{}
	problem error
	stopped chan struct{}
}

func (c *chanListener) Listen(ctx context.Context, channel string, wake func(), problem func(error)) {
	defer close(c.stopped)
	if c.problem != nil {
		problem(c.problem)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.notify:
			wake()
		}
	}
}

// lockedBuffer is a log sink safe for the forwarder's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestACustomListenerWakesAnIdleRelayAndStopsWithIt(t *testing.T) {
	s := newDB(t)
	rec := &recorder{}
	passes := make(chan struct{}, 100)
	l := &chanListener{notify: make(chan struct{}), stopped: make(chan struct{})}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		Listener: l, PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(forwarder.Report) {
			select {
			case passes <- struct{}{}:
			default:
			}
		},
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	<-passes // the first pass found nothing; the next poll is an hour away
	insertN(t, s.DB, "orders", "m1")
	l.notify <- struct{}{} // received: the listener runs
	await.Until(t, func() bool { return len(rec.ids()) == 1 }, "the row is delivered")
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	<-l.stopped // Close ended the listener
}

func TestListenerProblemsAreLoggedWithoutThePassword(t *testing.T) {
	s := newDB(t)
	var logs lockedBuffer
	dsn := "postgres://app:s3cret@127.0.0.1:1/test?sslmode=disable"
	l := &chanListener{notify: make(chan struct{}), stopped: make(chan struct{}),
		problem: errors.New(`dial failed for "` + dsn + `"`)}
	f, err := forwarder.New(s.DB, &recorder{}, watermill.NewStdLoggerWithOut(&logs, false, false), forwarder.Config{Listener: l})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	<-l.stopped
	out := logs.String()
	require.Contains(t, out, "LISTEN connection problem")
	require.False(t, strings.Contains(out, "s3cret"), "the password reached the log:\n%s", out)
}

// lib/pq's Listener.Listen waits for a connection, forever when the LISTEN
// server is unreachable: the relay must poll anyway, and Close must return.
func TestUnreachableListenURLNeitherBlocksRunNorClose(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		ListenURL:    "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1",
		PollInterval: 10 * time.Millisecond, MaxPollInterval: 20 * time.Millisecond,
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	await.Until(t, func() bool { return len(rec.ids()) == 1 }, "polling relays the row")
	insertN(t, s.DB, "orders", "m2")
	await.Until(t, func() bool { return len(rec.ids()) == 2 }, "polling keeps relaying")
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	require.NoError(t, waitOrFail(t, closed, "Close returning"))
	require.NoError(t, waitOrFail(t, done, "Run returning"))
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m2").Status)
}
