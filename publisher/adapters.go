package publisher

import outbox "github.com/fencedoutbox/watermill-outbox"

// CodeSubscribeUnsupported is returned by the subscriber side of the
// watermill-sql schema adapters (sub-packages sqlv3 and sqlv4):
// messaging_outbox is read by the outbox forwarder, which claims rows with
// fencing, not by watermill-sql's subscriber.
const CodeSubscribeUnsupported outbox.Code = "OUTBOX_SUBSCRIBE_UNSUPPORTED"

// ErrSubscribeUnsupported matches CodeSubscribeUnsupported with errors.Is.
var ErrSubscribeUnsupported = &outbox.Error{Code: CodeSubscribeUnsupported}

// SubscribeUnsupportedDetail is the reason the adapters give.
const SubscribeUnsupportedDetail = "messaging_outbox is read by the watermill-outbox forwarder, not by watermill-sql's subscriber; " +
	"subscribe to the downstream broker the forwarder publishes to"
