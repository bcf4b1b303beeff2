package testdb

import (
	"strings"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// The factory refuses, before the database does, the rows the schema's
// CHECKs would refuse, and says which rule they break.
func TestFactoryRefusesInvalidRows(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		row  OutboxRow
		want string
	}{
		{Row(envelope.Row{Status: envelope.StatusPending, PublishedAt: now}), "published_at_check"},
		{Row(envelope.Row{Status: envelope.StatusAmbiguous}, SQL("published_at", "now()")), "published_at_check"},
		{Row(envelope.Row{Status: envelope.StatusPublished, ParkedAt: now}), "parked_at_check"},
		{Row(envelope.Row{Status: "DONE"}), "not one of the six states"},
		{Row(envelope.Row{MessageID: "m", RoutingKey: "k"}), "generated routing_key"},
		{Row(envelope.Row{}, SQL("routing_key", "'k'")), "generated"},
		{Row(envelope.Row{}, SQL("no_such_column", "1")), "not an insertable"},
	} {
		_, _, err := insertStatement([]OutboxRow{c.row})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: got %v, want an error naming %q", c.row, err, c.want)
		}
	}
}

// Columns a row does not set are DEFAULT when another row sets them, and a
// seq from any row brings OVERRIDING SYSTEM VALUE.
func TestFactoryStatement(t *testing.T) {
	q, args, err := insertStatement([]OutboxRow{
		Row(envelope.Row{MessageID: "a", Seq: 9}),
		Row(envelope.Row{MessageID: "b", Status: envelope.StatusFailed}, SQL("created_at", "now() - interval '1 hour'")),
	})
	if err != nil {
		t.Fatal(err)
	}
	want := "INSERT INTO messaging_outbox (message_id, destination, payload, status, seq, created_at, parked_at) OVERRIDING SYSTEM VALUE VALUES " +
		"($1, $2, $3, $4, $5, DEFAULT, DEFAULT), ($6, $7, $8, $9, DEFAULT, now() - interval '1 hour', now())"
	if q != want || len(args) != 9 {
		t.Fatalf("got  %s (%d args)\nwant %s", q, len(args), want)
	}
}
