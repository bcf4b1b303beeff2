package console

import (
	"encoding/hex"
	"net/http"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/status"
)

// PayloadPreview is how many payload bytes the inspector shows.
const PayloadPreview = 4096

type field struct{ Name, Value string }

type rowData struct {
	Columns     []field
	Headers     []field
	Size        int
	Kind        string // text or binary (hex)
	Preview     string
	Cut         bool
	ParkedQuery string // the parked filter of this row's destination and code
}

func (s *Server) row(w http.ResponseWriter, r *http.Request, v *viewer) error {
	id := r.URL.Query().Get("id")
	row, err := status.Message(r.Context(), v.db, id)
	if outbox.CodeOf(err) == status.CodeMessageNotFound || outbox.CodeOf(err) == outbox.CodeMessageIDRequired {
		return &pageErr{status: http.StatusNotFound, err: err}
	}
	if err != nil && row.MessageID == "" {
		return err
	}
	d := rowData{Size: len(row.Payload)}
	for _, c := range columns(row) {
		d.Columns = append(d.Columns, c)
	}
	keys := make([]string, 0, len(row.Headers))
	for k := range row.Headers {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		d.Headers = append(d.Headers, field{k, row.Headers[k]})
	}
	shown := row.Payload
	if len(shown) > PayloadPreview {
		shown, d.Cut = shown[:PayloadPreview], true
		for k := 0; k < utf8.UTFMax && len(shown) > 0 && !utf8.Valid(shown) && utf8.Valid(row.Payload); k++ {
			shown = shown[:len(shown)-1]
		}
	}
	if utf8.Valid(row.Payload) {
		d.Kind, d.Preview = "text", visible(string(shown))
	} else {
		d.Kind, d.Preview = "binary, shown as hex", hex.EncodeToString(shown)
	}
	pd := v.data("Row "+visible(row.MessageID), "parked")
	if err != nil {
		pd.Error = s.errText(err) // a corrupt row is shown, then reported
	}
	pd.Data = d
	s.render(w, http.StatusOK, "row", pd)
	return nil
}

func tstr(t time.Time) string {
	if t.IsZero() {
		return "NULL"
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func sstr(s string) string {
	if s == "" {
		return "NULL"
	}
	return s
}

// columns lists every column of the row in schema order, as outboxctl
// inspect prints them.
func columns(r envelope.Row) []field {
	agg := "NULL"
	if r.AggregateVersion != nil {
		agg = strconv.FormatInt(*r.AggregateVersion, 10)
	}
	return []field{
		{"message_id", r.MessageID}, {"destination", r.Destination}, {"status", string(r.Status)},
		{"seq", strconv.FormatInt(r.Seq, 10)}, {"created_at", tstr(r.CreatedAt)}, {"occurred_at", tstr(r.OccurredAt)},
		{"published_at", tstr(r.PublishedAt)}, {"attempts", strconv.Itoa(r.Attempts)}, {"next_attempt_at", tstr(r.NextAttemptAt)},
		{"lease_owner", sstr(r.LeaseOwner)}, {"lease_token", strconv.FormatInt(r.LeaseToken, 10)}, {"lease_expires_at", tstr(r.LeaseExpiresAt)},
		{"last_failure_code", sstr(r.LastFailureCode)}, {"last_failure_detail", sstr(r.LastFailureDetail)},
		{"last_attempt_at", tstr(r.LastAttemptAt)}, {"parked_at", tstr(r.ParkedAt)}, {"producer", sstr(r.Producer)},
		{"correlation_id", sstr(r.CorrelationID)}, {"causation_id", sstr(r.CausationID)}, {"tenant", sstr(r.Tenant)},
		{"partition_key", sstr(r.PartitionKey)}, {"ordering_key", sstr(r.OrderingKey)}, {"routing_key", r.RoutingKey},
		{"traceparent", sstr(r.Traceparent)}, {"tracestate", sstr(r.Tracestate)}, {"baggage", sstr(r.Baggage)},
		{"schema_subject", sstr(r.SchemaSubject)}, {"schema_version", sstr(r.SchemaVersion)}, {"content_type", sstr(r.ContentType)},
		{"message_type", sstr(r.MessageType)}, {"aggregate_type", sstr(r.AggregateType)}, {"aggregate_id", sstr(r.AggregateID)},
		{"aggregate_version", agg},
	}
}
