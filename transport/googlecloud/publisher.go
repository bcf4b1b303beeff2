package googlecloud

import (
	"cmp"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"github.com/ThreeDotsLabs/watermill"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"google.golang.org/api/option"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Default timeouts. The forwarder enforces its own publish timeout as well;
// keep PublishTimeout at or below it so the client gives up first and
// reports why.
const (
	DefaultConnectTimeout = 10 * time.Second
	DefaultPublishTimeout = 5 * time.Second
)

// Config selects the project and the behaviour of the Pub/Sub publisher.
// Only ProjectID is required.
type Config struct {
	// ProjectID is the Google Cloud project (any non-empty name for pstest or
	// an emulator).
	ProjectID string

	// CreateMissingTopics creates a topic on first publish when it does not
	// exist. Off by default: a missing topic is a rejection (FAILED row).
	CreateMissingTopics bool

	// EnableMessageOrdering sends msg.partition_key as the Pub/Sub ordering
	// key. When on, a failed publish resumes its ordering key automatically,
	// so the forwarder's retry of that row is not refused by a paused key.
	EnableMessageOrdering bool

	// ConnectTimeout bounds client creation (default 10s); PublishTimeout
	// bounds each Publish call (default 5s).
	ConnectTimeout time.Duration
	PublishTimeout time.Duration

	// PublishSettings are passed to the client library. Nil means the
	// library defaults with Timeout = PublishTimeout: the library keeps
	// retrying a publish in the background after Publish gave up, and
	// Close waits for those retries, so its default 60s would make Close
	// hang for a minute against an unavailable service.
	PublishSettings *pubsub.PublishSettings

	// Passed to the client library unchanged (nil/empty = library defaults).
	ClientOptions []option.ClientOption
	ClientConfig  *pubsub.ClientConfig
}

// Validate refuses a Config the publisher cannot work with
// (OUTBOX_INVALID_CONFIG, naming the field).
func (c Config) Validate() error {
	const op = "googlecloud.Config"
	if c.ProjectID == "" {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "ProjectID is required")
	}
	if c.ConnectTimeout < 0 || c.PublishTimeout < 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "ConnectTimeout and PublishTimeout must not be negative (0 means the default)")
	}
	return nil
}

// WatermillConfig returns the watermill-googlecloud configuration NewPublisher
// uses, for callers that want to adjust a field this package does not expose.
func (c Config) WatermillConfig() wgc.PublisherConfig {
	publishTimeout := cmp.Or(c.PublishTimeout, DefaultPublishTimeout)
	settings := c.PublishSettings
	if settings == nil {
		s := pubsub.DefaultPublishSettings
		s.Timeout = publishTimeout
		settings = &s
	}
	return wgc.PublisherConfig{
		ProjectID:                 c.ProjectID,
		DoNotCreateTopicIfMissing: !c.CreateMissingTopics,
		EnableMessageOrdering:     c.EnableMessageOrdering,
		EnableMessageOrderingAutoResumePublishOnError: c.EnableMessageOrdering,
		ConnectTimeout:  cmp.Or(c.ConnectTimeout, DefaultConnectTimeout),
		PublishTimeout:  publishTimeout,
		PublishSettings: settings,
		ClientOptions:   c.ClientOptions,
		ClientConfig:    c.ClientConfig,
		Marshaler:       Marshaler{Ordering: c.EnableMessageOrdering},
	}
}

// NewPublisher connects to Pub/Sub and returns the watermill publisher to
// hand to the forwarder. A nil logger logs nothing. Refuses an invalid
// Config with OUTBOX_INVALID_CONFIG; connection failures come back as the
// client library reports them.
func NewPublisher(cfg Config, logger watermill.LoggerAdapter) (*wgc.Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return wgc.NewPublisher(cfg.WatermillConfig(), logger)
}

// CodeReservedAttribute: a message carried metadata under the attribute name
// that transports the message UUID. Returned by Marshaler.Marshal (and so by
// Publish); classified as a rejection.
const CodeReservedAttribute outbox.Code = "PUBSUB_RESERVED_ATTRIBUTE"

// ErrReservedAttribute matches CodeReservedAttribute with errors.Is.
var ErrReservedAttribute = &outbox.Error{Code: CodeReservedAttribute}

// Marshaler turns a relayed message into a Pub/Sub message: payload as data,
// metadata as attributes, the UUID under wgc.UUIDHeaderKey and, with
// Ordering, msg.partition_key as the ordering key. Unmarshal is
// watermill-googlecloud's default, so consumers may use either.
type Marshaler struct {
	Ordering bool
}

var _ wgc.MarshalerUnmarshaler = Marshaler{}

// Marshal implements wgc.Marshaler: watermill-googlecloud's default
// marshaler, after our own typed check for the reserved attribute. The check
// is by presence, not value: the library only refuses a non-empty value, and
// copies metadata over the UUID attribute, so an empty one would erase it.
func (m Marshaler) Marshal(topic string, msg *message.Message) (*pubsub.Message, error) {
	if _, ok := msg.Metadata[wgc.UUIDHeaderKey]; ok {
		return nil, outbox.Errorf(CodeReservedAttribute, "googlecloud.Marshal",
			"message %s: metadata key %q carries the message UUID and may not be set", msg.UUID, wgc.UUIDHeaderKey)
	}
	out, err := wgc.DefaultMarshalerUnmarshaler{}.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	if m.Ordering {
		out.OrderingKey = msg.Metadata.Get(envelope.KeyPartitionKey)
	}
	return out, nil
}

// Unmarshal implements wgc.Unmarshaler with watermill-googlecloud's default.
func (Marshaler) Unmarshal(m *pubsub.Message) (*message.Message, error) {
	return wgc.DefaultMarshalerUnmarshaler{}.Unmarshal(m)
}
