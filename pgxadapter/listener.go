package pgxadapter

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/redact"
)

// Listener is a forwarder.Listener on a dedicated pgx connection: LISTEN on
// the channel, a wake-up per notification and after every (re)connection,
// reconnecting with a back-off from 100 ms to 10 s.
type Listener struct {
	cfg *pgx.ConnConfig
}

var _ forwarder.Listener = (*Listener)(nil)

// NewListener parses connString with pgx's parser (URL or key=value, pgx
// parameters included; the pool_* parameters of a pgxpool DSN are dropped,
// pgx.ParseConfig would send them to the server). A connection string pgx
// cannot parse is refused with OUTBOX_INVALID_CONFIG, its password masked.
func NewListener(connString string) (*Listener, error) {
	cfg, err := pgx.ParseConfig(stripPoolParams(connString))
	if err != nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "pgxadapter.NewListener",
			"the connection string cannot be parsed by pgx: %v", redact.Error(err, connString))
	}
	return &Listener{cfg: cfg}, nil
}

// Listen implements forwarder.Listener.
func (l *Listener) Listen(ctx context.Context, channel string, wake func(), problem func(error)) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := l.session(ctx, channel, wake, func() { backoff = 100 * time.Millisecond })
		if ctx.Err() != nil {
			return
		}
		problem(err)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, 10*time.Second)
	}
}

// session is one connection's life: connect, LISTEN, wake per
// notification until an error or ctx.
func (l *Listener) session(ctx context.Context, channel string, wake, connected func()) error {
	conn, err := pgx.ConnectConfig(ctx, l.cfg)
	if err != nil {
		return err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		return err
	}
	connected()
	wake() // notifications sent while disconnected are lost
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		wake()
	}
}
