package forwarder

import (
	"context"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// HandlerName is the name of the router handler RouterPlugin adds.
const HandlerName = "outbox_forwarder"

// RouterPlugin returns a watermill router plugin that runs the forwarder
// with the router: it starts when the router runs and is drained when the
// router closes (the router waits for it like for any handler). The plugin
// refuses to start the router with RELAY_MODE_CONFLICT when the database
// records CDC mode.
//
// A relay that stops on its own while the router runs (Run returned an
// error: RELAY_MODE_CONFLICT when a heartbeat finds the mode switched to CDC
// or a CDC consumer live, a schema or configuration refusal) closes the
// router instead of leaving it running without a relay: the router's Run
// returns (watermill's Router.Run returns nil after a Close), and
// [Forwarder.RouterErr] says why.
func (f *Forwarder) RouterPlugin() message.RouterPlugin {
	return func(r *message.Router) error {
		if err := relaymode.RequireMode(context.Background(), f.db, relaymode.ModePolling, "forwarder.RouterPlugin",
			"a polling forwarder must not run (switch back with `outboxctl debezium disable`)"); err != nil {
			return err
		}
		r.AddConsumerHandler(HandlerName, HandlerName, lifecycle{f: f, r: r}, func(*message.Message) error { return nil })
		return nil
	}
}

// RouterErr returns the error the forwarder's Run returned under
// RouterPlugin: nil while it runs, and after a clean stop. When the router's
// Run returns without the application having closed the router, RouterErr
// says why the relay closed it (errors.Is ErrRelayModeConflict from package
// relaymode, for instance).
func (f *Forwarder) RouterErr() error {
	if err := f.routerErr.Load(); err != nil {
		return *err
	}
	return nil
}

// lifecycle adapts the forwarder to the router's handler lifecycle: Subscribe
// runs the forwarder, the returned channel never carries messages and closes
// when Run returns; Close (called by the router on close) drains it. Run
// returning an error while the router still runs closes the router.
type lifecycle struct {
	f *Forwarder
	r *message.Router
}

func (l lifecycle) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	ch := make(chan *message.Message)
	go func() {
		err := l.f.Run(ctx)
		if err != nil {
			l.f.routerErr.Store(&err)
		}
		// The handler stops once ch is closed; the router's Close waits for
		// it, so ch is closed first.
		close(ch)
		if err == nil {
			return
		}
		if l.r.IsClosed() {
			l.f.logger.Error("Outbox forwarder stopped with an error", err, nil)
			return
		}
		l.f.logger.Error("Outbox forwarder stopped with an error; closing the router", err, watermill.LogFields{"handler": HandlerName})
		if cerr := l.r.Close(); cerr != nil {
			l.f.logger.Error("Router not closed after the forwarder stopped", cerr, nil)
		}
	}()
	return ch, nil
}

func (l lifecycle) Close() error { return l.f.Close() }
