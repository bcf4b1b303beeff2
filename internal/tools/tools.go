//go:build tools

// Package tools pins modules that later packages import, so go.mod and go.sum
// stay complete while packages are added in parallel.
package tools

import (
	_ "cloud.google.com/go/pubsub/v2/pstest"
	_ "github.com/Shopify/toxiproxy/v2"
	_ "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	_ "github.com/ThreeDotsLabs/watermill-googlecloud/v2/pkg/googlecloud"
	_ "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	_ "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	_ "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	_ "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	_ "github.com/ThreeDotsLabs/watermill/components/forwarder"
	_ "github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/ThreeDotsLabs/watermill/pubsub/tests"
	_ "github.com/jackc/pglogrepl"
	_ "github.com/lib/pq"
	_ "github.com/pressly/goose/v3"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/prometheus/client_golang/prometheus/promhttp"
	_ "github.com/prometheus/client_golang/prometheus/testutil"
	_ "github.com/spf13/cobra"
	_ "github.com/stretchr/testify/require"
	_ "github.com/twmb/franz-go/pkg/kfake"
	_ "go.opentelemetry.io/otel/sdk/trace"
	_ "go.opentelemetry.io/otel/sdk/trace/tracetest"
	_ "go.uber.org/goleak"
	_ "google.golang.org/grpc/codes"
	_ "google.golang.org/grpc/status"
)
