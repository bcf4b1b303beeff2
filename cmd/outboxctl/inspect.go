package main

import (
	"context"
	"database/sql"
	"encoding/base64"
	"fmt"
	"slices"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/status"
)

func (a *app) inspectCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect <message-id>",
		Short: "Print every column of one outbox row: headers, lease, attempts, failure",
		Args:  cobra.ExactArgs(1),
		RunE: a.withDB(func(ctx context.Context, db *sql.DB, _ *cobra.Command, args []string) error {
			row, err := status.Message(ctx, db, args[0])
			if err != nil && row.MessageID == "" {
				return err
			}
			// A corrupt row is still shown (its identity and raw state),
			// then reported, so the operator sees what is wrong with it.
			if a.json {
				if perr := a.printJSON(inspectJSON(row)); perr != nil {
					return perr
				}
			} else if perr := a.printInspect(row); perr != nil {
				return perr
			}
			return err
		}),
	}
}

// column is one named value of a row, in schema order.
type column struct {
	name  string
	value any // nil for SQL NULL
}

func opt[T comparable](v T) any {
	var zero T
	if v == zero {
		return nil
	}
	return v
}

func optTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UTC()
}

// columns lists the 34 columns and routing_key in schema order. Headers and
// payload are rendered by the caller.
func columns(r envelope.Row) []column {
	var aggV any
	if r.AggregateVersion != nil {
		aggV = *r.AggregateVersion
	}
	return []column{
		{"message_id", r.MessageID},
		{"destination", r.Destination},
		{"status", string(r.Status)},
		{"seq", r.Seq},
		{"created_at", optTime(r.CreatedAt)},
		{"occurred_at", optTime(r.OccurredAt)},
		{"published_at", optTime(r.PublishedAt)},
		{"attempts", r.Attempts},
		{"next_attempt_at", optTime(r.NextAttemptAt)},
		{"lease_owner", opt(r.LeaseOwner)},
		{"lease_token", r.LeaseToken},
		{"lease_expires_at", optTime(r.LeaseExpiresAt)},
		{"last_failure_code", opt(r.LastFailureCode)},
		{"last_failure_detail", opt(r.LastFailureDetail)},
		{"last_attempt_at", optTime(r.LastAttemptAt)},
		{"parked_at", optTime(r.ParkedAt)},
		{"producer", opt(r.Producer)},
		{"correlation_id", opt(r.CorrelationID)},
		{"causation_id", opt(r.CausationID)},
		{"tenant", opt(r.Tenant)},
		{"partition_key", opt(r.PartitionKey)},
		{"ordering_key", opt(r.OrderingKey)},
		{"routing_key", r.RoutingKey},
		{"traceparent", opt(r.Traceparent)},
		{"tracestate", opt(r.Tracestate)},
		{"baggage", opt(r.Baggage)},
		{"schema_subject", opt(r.SchemaSubject)},
		{"schema_version", opt(r.SchemaVersion)},
		{"content_type", opt(r.ContentType)},
		{"message_type", opt(r.MessageType)},
		{"aggregate_type", opt(r.AggregateType)},
		{"aggregate_id", opt(r.AggregateID)},
		{"aggregate_version", aggV},
	}
}

func inspectJSON(r envelope.Row) map[string]any {
	m := map[string]any{}
	for _, c := range columns(r) {
		m[c.name] = c.value
	}
	headers := r.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	m["headers"] = headers
	m["payload_base64"] = base64.StdEncoding.EncodeToString(r.Payload)
	if utf8.Valid(r.Payload) {
		m["payload_text"] = string(r.Payload)
	}
	m["payload_bytes"] = len(r.Payload)
	return m
}

func (a *app) printInspect(r envelope.Row) error {
	t := newTable(a.stdout)
	for _, c := range columns(r) {
		t.row(c.name, c.value)
	}
	payload := fmt.Sprintf("%d bytes, base64 %s", len(r.Payload), base64.StdEncoding.EncodeToString(r.Payload))
	if utf8.Valid(r.Payload) {
		payload = fmt.Sprintf("%d bytes: %s", len(r.Payload), r.Payload)
	}
	t.row("payload", payload)
	if err := t.flush(); err != nil {
		return err
	}
	section(a.stdout, "HEADERS")
	t = newTable(a.stdout)
	keys := make([]string, 0, len(r.Headers))
	for k := range r.Headers {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		t.row(k, fmt.Sprintf("%q", r.Headers[k]))
	}
	return t.flush()
}
