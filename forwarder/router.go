package forwarder

import (
	"context"

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
func (f *Forwarder) RouterPlugin() message.RouterPlugin {
	return func(r *message.Router) error {
		if err := relaymode.RequireMode(context.Background(), f.db, relaymode.ModePolling, "forwarder.RouterPlugin",
			"a polling forwarder must not run (switch back with `outboxctl debezium disable`)"); err != nil {
			return err
		}
		r.AddConsumerHandler(HandlerName, HandlerName, lifecycle{f: f}, func(*message.Message) error { return nil })
		return nil
	}
}

// lifecycle adapts the forwarder to the router's handler lifecycle: Subscribe
// runs the forwarder, the returned channel never carries messages and closes
// when Run returns; Close (called by the router on close) drains it.
type lifecycle struct{ f *Forwarder }

func (l lifecycle) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	ch := make(chan *message.Message)
	go func() {
		defer close(ch)
		if err := l.f.Run(ctx); err != nil {
			l.f.logger.Error("Outbox forwarder stopped with an error", err, nil)
		}
	}()
	return ch, nil
}

func (l lifecycle) Close() error { return l.f.Close() }
