package main

import (
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/status"
)

// DefaultPayloadPreview is how many payload bytes inspect shows by default.
const DefaultPayloadPreview = 512

func (a *app) inspectCommand() *cobra.Command {
	var (
		previewBytes int
		payloadTo    string
	)
	cmd := &cobra.Command{
		Use:   "inspect <message-id>",
		Short: "Print every column of one outbox row: headers, lease, attempts, failure, a payload preview",
		Long: `Print every column of one outbox row. The payload is previewed, never
dumped: at most --payload-bytes bytes, printable text as it is with control
characters escaped (\x1b, \n), anything that is not UTF-8 text as hex, with
the full size. --payload-to FILE writes the raw payload to FILE (mode 0600,
through a temporary file renamed into place; a symlink at FILE is replaced,
not followed), or to stdout alone with --payload-to -.

With --json the payload is complete: payload_base64, payload_text when it is
UTF-8 (JSON escapes control characters), payload_bytes.`,
		Args: cobra.ExactArgs(1),
		RunE: a.withDB(func(ctx context.Context, db *sql.DB, _ *cobra.Command, args []string) error {
			if previewBytes < 0 {
				return outbox.Errorf(CodeUsage, "outboxctl inspect", "--payload-bytes is %d; use 0 or more", previewBytes)
			}
			row, err := status.Message(ctx, db, args[0])
			if err != nil && row.MessageID == "" {
				return err
			}
			if payloadTo == "-" {
				if _, werr := a.stdout.Write(row.Payload); werr != nil {
					return werr
				}
				return err
			}
			if payloadTo != "" {
				if werr := writeFileAtomic(payloadTo, row.Payload); werr != nil {
					return werr
				}
				a.progress("wrote %d payload bytes to %s", len(row.Payload), payloadTo)
			}
			// A corrupt row is still shown (its identity and raw state),
			// then reported, so the operator sees what is wrong with it.
			if a.json {
				if perr := a.printJSON(inspectJSON(row)); perr != nil {
					return perr
				}
			} else if perr := a.printInspect(row, previewBytes); perr != nil {
				return perr
			}
			return err
		}),
	}
	cmd.Flags().IntVar(&previewBytes, "payload-bytes", DefaultPayloadPreview, "most payload bytes to preview")
	cmd.Flags().StringVar(&payloadTo, "payload-to", "", "write the raw payload to this file (0600; - = stdout, instead of the table)")
	return cmd
}

// payloadPreview describes p in one line for a terminal: its size, its kind
// and at most max bytes of it, printable text as it is (control characters
// escaped), anything else as hex. A cut preview ends with "...".
func payloadPreview(p []byte, max int) string {
	if len(p) == 0 {
		return "0 bytes"
	}
	shown := p
	if len(shown) > max {
		shown = shown[:max]
		// Do not cut a UTF-8 sequence in two: back off to a rune start.
		for k := 0; k < utf8.UTFMax && len(shown) > 0 && !utf8.Valid(shown) && utf8.Valid(p); k++ {
			shown = shown[:len(shown)-1]
		}
	}
	more := ""
	if len(shown) < len(p) {
		more = fmt.Sprintf(", first %d shown", len(shown))
	}
	body := ""
	if utf8.Valid(p) {
		body = fmt.Sprintf("%d bytes, text%s: %s", len(p), more, escape(string(shown)))
	} else {
		body = fmt.Sprintf("%d bytes, binary (hex)%s: %s", len(p), more, hex.EncodeToString(shown))
	}
	if len(shown) < len(p) {
		body += "..."
	}
	return body
}

// writeFileAtomic writes data to path with mode 0600 through a temporary
// file in the same directory renamed onto path: a reader never sees half a
// file, and a symlink at path is replaced, never followed.
func writeFileAtomic(path string, data []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			_ = os.Remove(tmp)
		}
	}()
	if err := f.Chmod(0o600); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	ok = true
	return nil
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

func (a *app) printInspect(r envelope.Row, previewBytes int) error {
	t := newTable(a.stdout)
	for _, c := range columns(r) {
		t.row(c.name, c.value)
	}
	// Not through cell: the preview is escaped already, and its own
	// backslashes must not be escaped twice.
	fmt.Fprintf(t.w, "payload\t%s\n", payloadPreview(r.Payload, previewBytes))
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
