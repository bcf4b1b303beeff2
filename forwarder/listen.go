package forwarder

import (
	"context"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/lib/pq"

	"github.com/fencedoutbox/watermill-outbox/internal/redact"
)

// Listener wakes the forwarder when a publisher's NOTIFY arrives, so a
// committed row is relayed without waiting for the next poll. Set
// Config.Listener for a driver of your own (pgx: see the README); with only
// Config.ListenURL set the forwarder uses lib/pq's listener (PQListener).
//
// Notifications only shorten the wait: polling continues whatever the
// listener does, so a lost notification delays a message by at most
// MaxPollInterval. Any login may NOTIFY the channel, so a notification never
// shortens a failure backoff, and after two woken passes in a row that found
// nothing the next woken pass waits PollInterval/10 (at most 50 ms)
// (TestANotifyFloodStartsOneWokenPassPerGap, TestWokenPassesThatFindRowsAreNotHeldBack,
// TestNotificationsDoNotCutTheFailureBackoff).
type Listener interface {
	// Listen listens on channel until ctx is done, then returns. It calls
	// wake after every notification and after every (re)connection, since
	// notifications sent while disconnected are lost. It reconnects by
	// itself and reports each connection problem to problem; it must not
	// return before ctx is done. Calls to wake and problem never block for
	// long.
	Listen(ctx context.Context, channel string, wake func(), problem func(error))
}

// PQListener is the Listener on lib/pq's pq.Listener: LISTEN on a dedicated
// connection to URL, reconnecting with a back-off of 100 ms up to 10 s.
type PQListener struct {
	// URL is a lib/pq connection string (URL or key=value form).
	URL string
}

// Listen implements Listener.
func (p PQListener) Listen(ctx context.Context, channel string, wake func(), problem func(error)) {
	l := pq.NewListener(p.URL, 100*time.Millisecond, 10*time.Second, func(ev pq.ListenerEventType, err error) {
		if err != nil {
			problem(err)
		}
	})
	// lib/pq's Listener.Listen waits until the listener has a connection,
	// which is forever when URL is unreachable, so it runs aside.
	listened := make(chan error, 1) // buffered: Listen returning after ctx must not block
	var bg sync.WaitGroup
	bg.Add(1)
	go func() {
		defer bg.Done()
		listened <- l.Listen(channel)
	}()
	defer bg.Wait()
	defer l.Close() // runs before bg.Wait: ends a Listen still waiting
	results := (<-chan error)(listened)
	for {
		select {
		case <-ctx.Done():
			return
		case err := <-results:
			results = nil
			if err != nil {
				// The listener keeps reconnecting and re-issues LISTEN on
				// every new connection; polling goes on regardless.
				problem(err)
			}
		case _, ok := <-l.NotificationChannel():
			if !ok {
				return
			}
			// A nil notification means the connection was re-established:
			// notifications may have been missed, so wake up too.
			wake()
		}
	}
}

// pgxOnlyParams are connection parameters pgx (and pgxpool) understand but
// lib/pq does not: lib/pq sends unknown keys to the server as run-time
// parameters, which refuses them ("unrecognized configuration parameter") on
// every reconnect, so a listener on such a DSN never listens.
var pgxOnlyParams = []string{
	"pool_", "statement_cache_capacity", "description_cache_capacity",
	"default_query_exec_mode", "prefer_simple_protocol", "min_read_buffer_size",
}

// dsnKey finds the keys of a key=value connection string, spaces around
// the "=" allowed as libpq allows them.
var dsnKey = regexp.MustCompile(`(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)\s*=`)

// checkListenURL refuses a ListenURL lib/pq's listener cannot use, with the
// reason (and never the password).
func checkListenURL(dsn string) string {
	if strings.TrimSpace(dsn) == "" {
		return "ListenURL is blank"
	}
	var keys []string
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "ListenURL is not a valid URL: " + redact.Error(err, dsn).Error()
		}
		for k := range u.Query() {
			keys = append(keys, k)
		}
	} else if strings.Contains(dsn, "://") {
		return "ListenURL must be a postgres:// or postgresql:// URL or a key=value connection string"
	} else {
		for _, m := range dsnKey.FindAllStringSubmatch(dsn, -1) {
			keys = append(keys, m[1])
		}
	}
	// lib/pq's own parse: values it refuses (sslmode=bogus,
	// connect_timeout=abc, a service file that is not there), in either form.
	if _, err := pq.NewConnector(dsn); err != nil {
		return "ListenURL is not a valid connection string: " + redact.Error(err, dsn).Error()
	}
	for _, k := range keys {
		for _, p := range pgxOnlyParams {
			if k == p || (strings.HasSuffix(p, "_") && strings.HasPrefix(k, p)) {
				return "ListenURL has the parameter " + k + ", which only pgx understands: lib/pq's listener would send it to the server and be refused on every connection; " +
					"remove it from ListenURL, or set Config.Listener to a pgx listener instead"
			}
		}
	}
	return ""
}

// listener is the Listener Config selects: Config.Listener, or lib/pq's on
// ListenURL, or none.
func (c Config) listener() Listener {
	switch {
	case c.Listener != nil:
		return c.Listener
	case c.ListenURL != "":
		return PQListener{URL: c.ListenURL}
	}
	return nil
}

// startListening runs the configured Listener in the background until
// stopping is closed, and returns a channel that receives a value per
// wake-up (nil when no listener is configured). Problems are logged with
// every secret of ListenURL masked.
func startListening(cfg Config, logger watermill.LoggerAdapter, stopping <-chan struct{}, bg *sync.WaitGroup) <-chan struct{} {
	l := cfg.listener()
	if l == nil {
		return nil
	}
	wake := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	bg.Add(2)
	go func() {
		defer bg.Done()
		defer cancel()
		<-stopping
	}()
	go func() {
		defer bg.Done()
		l.Listen(ctx, cfg.NotifyChannel, func() {
			select {
			case wake <- struct{}{}:
			default:
			}
		}, func(err error) {
			logger.Error("Outbox LISTEN connection problem; polling continues", redact.Error(err, cfg.ListenURL),
				watermill.LogFields{"channel": cfg.NotifyChannel})
		})
	}()
	return wake
}
