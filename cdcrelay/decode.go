package cdcrelay

import (
	"encoding/hex"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// column is one value of an inserted tuple in PostgreSQL's text format, as
// pgoutput sends it (and as a simple-protocol query returns it).
type column struct {
	name string
	null bool
	text []byte
}

func undecodable(format string, args ...any) error {
	return outbox.Errorf(outbox.CodeCorruptRow, "cdcrelay.decode", format, args...)
}

// identity is what a refused row still says about itself, as envelope.ScanRow
// returns it with its error: the message id and destination, when they were
// decoded before the column that failed (message_id and destination are the
// table's first columns), for the operator's log.
func identity(r envelope.Row) envelope.Row {
	return envelope.Row{MessageID: r.MessageID, Destination: r.Destination}
}

// decodeRow builds the row an INSERT carried, by column name, so the column
// order of the table (and columns this code does not know, such as
// created_at_utc) do not matter. Columns the envelope needs but the tuple
// lacks stay zero; message_id, destination and created_at are required. A
// status that is present but not one of the six states is refused, as
// envelope.ScanRow refuses it, with OUTBOX_CORRUPT_ROW.
func decodeRow(cols []column) (envelope.Row, error) {
	var r envelope.Row
	seen := map[string]bool{}
	for _, c := range cols {
		seen[c.name] = !c.null
		if c.null {
			continue
		}
		s := string(c.text)
		var err error
		switch c.name {
		case "message_id":
			r.MessageID = s
		case "destination":
			r.Destination = s
		case "payload":
			r.Payload, err = parseBytea(s)
		case "headers":
			r.Headers, err = envelope.DecodeHeaders(c.text)
		case "status":
			// The same refusal as envelope.ScanRow: a state this code does
			// not know is not guessed at.
			r.Status = envelope.Status(s)
			if !r.Status.Valid() {
				err = unknownStatusError(s)
			}
		case "seq":
			r.Seq, err = strconv.ParseInt(s, 10, 64)
		case "created_at":
			r.CreatedAt, err = parseTimestamptz(s)
		case "occurred_at":
			r.OccurredAt, err = parseTimestamptz(s)
		case "published_at":
			r.PublishedAt, err = parseTimestamptz(s)
		case "attempts":
			var n int64
			n, err = strconv.ParseInt(s, 10, 32)
			r.Attempts = int(n)
		case "next_attempt_at":
			r.NextAttemptAt, err = parseTimestamptz(s)
		case "lease_owner":
			r.LeaseOwner = s
		case "lease_token":
			r.LeaseToken, err = strconv.ParseInt(s, 10, 64)
		case "lease_expires_at":
			r.LeaseExpiresAt, err = parseTimestamptz(s)
		case "last_failure_code":
			r.LastFailureCode = s
		case "last_failure_detail":
			r.LastFailureDetail = s
		case "last_attempt_at":
			r.LastAttemptAt, err = parseTimestamptz(s)
		case "producer":
			r.Producer = s
		case "correlation_id":
			r.CorrelationID = s
		case "causation_id":
			r.CausationID = s
		case "tenant":
			r.Tenant = s
		case "partition_key":
			r.PartitionKey = s
		case "ordering_key":
			r.OrderingKey = s
		case "traceparent":
			r.Traceparent = s
		case "tracestate":
			r.Tracestate = s
		case "baggage":
			r.Baggage = s
		case "schema_subject":
			r.SchemaSubject = s
		case "schema_version":
			r.SchemaVersion = s
		case "content_type":
			r.ContentType = s
		case "message_type":
			r.MessageType = s
		case "aggregate_type":
			r.AggregateType = s
		case "aggregate_id":
			r.AggregateID = s
		case "aggregate_version":
			var n int64
			n, err = strconv.ParseInt(s, 10, 64)
			r.AggregateVersion = &n
		case "parked_at":
			r.ParkedAt, err = parseTimestamptz(s)
		case "routing_key":
			r.RoutingKey = s
		}
		if err != nil {
			return identity(r), undecodable("column %s of row %q: %v", c.name, r.MessageID, err)
		}
	}
	for _, req := range []string{"message_id", "destination", "created_at"} {
		if !seen[req] {
			return identity(r), undecodable("row %q has no %s", r.MessageID, req)
		}
	}
	if r.Payload == nil {
		r.Payload = []byte{}
	}
	if r.Headers == nil {
		r.Headers = map[string]string{}
	}
	r.RoutingKey = r.DownstreamKey()
	return r, nil
}

// parseBytea reads bytea's text output: the hex format (\x...) the relay asks
// for, and the escape format in case a server forces bytea_output=escape.
func parseBytea(s string) ([]byte, error) {
	if strings.HasPrefix(s, `\x`) {
		return hex.DecodeString(s[2:])
	}
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			out = append(out, s[i])
			continue
		}
		if i+1 < len(s) && s[i+1] == '\\' {
			out = append(out, '\\')
			i++
			continue
		}
		if i+3 < len(s) {
			n, err := strconv.ParseUint(s[i+1:i+4], 8, 8)
			if err == nil {
				out = append(out, byte(n))
				i += 3
				continue
			}
		}
		return nil, strconvError("bytea escape", s)
	}
	return out, nil
}

// timestamptz text output with DateStyle=ISO: "2006-01-02 15:04:05.999999+00",
// the offset with minutes (and, for historical zones, seconds) when not
// whole hours. The relay pins TimeZone=UTC, so "+00" is the usual case. A
// fraction after the seconds is accepted by time.Parse without a layout
// element.
var timestamptzLayouts = []string{
	"2006-01-02 15:04:05-07",
	"2006-01-02 15:04:05-07:00",
	"2006-01-02 15:04:05-07:00:00",
}

func parseTimestamptz(s string) (time.Time, error) {
	for _, l := range timestamptzLayouts {
		if t, err := time.Parse(l, s); err == nil {
			return t.UTC(), nil
		}
	}
	// infinity, -infinity and BC dates have no time.Time.
	return time.Time{}, strconvError("timestamptz", s)
}

type parseError struct{ kind, value string }

func (e parseError) Error() string {
	v := e.value
	if len(v) > 64 {
		v = v[:64] + "..."
	}
	return "cannot parse " + e.kind + " " + strconv.Quote(v)
}

func strconvError(kind, v string) error { return parseError{kind, v} }

type unknownStatusError string

func (e unknownStatusError) Error() string {
	return "status " + strconv.Quote(string(e)) + " is not a known state"
}

// decodeInsert is the row an INSERT's tuple carries: each value paired with
// its relation's column name, then decodeRow.
func decodeInsert(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) (envelope.Row, error) {
	if tuple == nil || len(tuple.Columns) != len(rel.Columns) {
		return envelope.Row{}, undecodable("insert into %s.%s has a tuple that does not match its relation", rel.Namespace, rel.RelationName)
	}
	cols := make([]column, len(tuple.Columns))
	for i, c := range tuple.Columns {
		cols[i].name = rel.Columns[i].Name
		switch c.DataType {
		case pglogrepl.TupleDataTypeNull:
			cols[i].null = true
		case pglogrepl.TupleDataTypeText:
			cols[i].text = c.Data
		default:
			return envelope.Row{}, undecodable("column %s arrived as tuple type %q; the relay reads text format only", cols[i].name, c.DataType)
		}
	}
	return decodeRow(cols)
}
