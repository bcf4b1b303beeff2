module github.com/fencedoutbox/watermill-outbox/transport/nats

go 1.26.0

replace github.com/fencedoutbox/watermill-outbox => ../..

replace github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest => ../../internal/testkit/brokertest

require (
	github.com/ThreeDotsLabs/watermill v1.5.1
	github.com/ThreeDotsLabs/watermill-nats/v2 v2.1.3
	github.com/fencedoutbox/watermill-outbox v0.0.0-00010101000000-000000000000
	github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest v0.0.0-00010101000000-000000000000
	github.com/nats-io/nats.go v1.55.0
	github.com/stretchr/testify v1.12.1
)

require (
	github.com/go-logr/logr v1.4.2 // indirect
	github.com/go-logr/stdr v1.2.2 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/klauspost/compress v1.20.3 // indirect
	github.com/lib/pq v1.12.3 // indirect
	github.com/lithammer/shortuuid/v3 v3.0.7 // indirect
	github.com/mfridman/interpolate v0.0.2 // indirect
	github.com/nats-io/nkeys v0.4.16 // indirect
	github.com/nats-io/nuid v1.0.1 // indirect
	github.com/oklog/ulid v1.3.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/pressly/goose/v3 v3.20.0 // indirect
	github.com/sethvargo/go-retry v0.2.4 // indirect
	go.opentelemetry.io/otel v1.29.0 // indirect
	go.opentelemetry.io/otel/metric v1.29.0 // indirect
	go.opentelemetry.io/otel/trace v1.29.0 // indirect
	go.uber.org/multierr v1.11.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/crypto v0.57.0 // indirect
	golang.org/x/sync v0.15.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
)
