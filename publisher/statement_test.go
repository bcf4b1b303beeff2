package publisher_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

// The publisher sends only the column set a batch needs (4, 11 or 21
// columns). Whichever it picks, the stored rows are the same as with every
// column: fields a message sets are stored, the others are NULL.
func TestNarrowStatementsStoreTheSameRows(t *testing.T) {
	occurred := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	minimal := func(t *testing.T) *message.Message {
		m := newMsg(t, "min")
		m.Metadata.Set("x-app", "v")
		return m
	}
	common := func(t *testing.T) *message.Message {
		m := newMsg(t, "common")
		envelope.SetCorrelationID(m, "corr")
		envelope.SetOccurredAt(m, occurred)
		return m
	}
	full := func(t *testing.T) *message.Message {
		m := newMsg(t, "full")
		envelope.SetAggregate(m, "Order", "7", 3)
		return m
	}
	cases := []struct {
		name  string
		make  []func(*testing.T) *message.Message
		nArgs int // parameters of the chosen statement (without NOTIFY); a batch adds the payloads' starts and lengths
	}{
		{"one minimal", []func(*testing.T) *message.Message{minimal}, 4},
		{"batch minimal", []func(*testing.T) *message.Message{minimal, minimal}, 4 + 2},
		{"one common", []func(*testing.T) *message.Message{common}, 11},
		{"batch common and minimal", []func(*testing.T) *message.Message{minimal, common}, 11 + 2},
		{"one full", []func(*testing.T) *message.Message{full}, 21},
		{"batch of all three", []func(*testing.T) *message.Message{minimal, full, common}, 21 + 2},
	}
	s := newSchema(t)
	prep, err := publisher.Prepare(context.Background(), s.DB)
	require.NoError(t, err)
	t.Cleanup(func() { _ = prep.Close() })
	for _, mode := range []struct {
		name string
		cfg  publisher.Config
	}{
		{"unprepared+notify", publisher.Config{Notify: true}},
		{"prepared", publisher.Config{Prepared: prep}},
		{"prepared+notify", publisher.Config{Notify: true, Prepared: prep}},
	} {
		for _, c := range cases {
			t.Run(mode.name+"/"+c.name, func(t *testing.T) { storeTheSameRows(t, s.DB, mode.cfg, c.make, c.nArgs, occurred) })
		}
	}
}

func storeTheSameRows(t *testing.T, db *sql.DB, cfg publisher.Config, makers []func(*testing.T) *message.Message, nArgs int, occurred time.Time) {
	ms := make([]*message.Message, len(makers))
	for i, mk := range makers {
		ms[i] = mk(t)
	}
	st, err := publisher.BuildInsert("orders", ms, publisher.Config{})
	require.NoError(t, err)
	require.Len(t, st.Args, nArgs)
	withNotify, err := publisher.BuildInsert("orders", ms, publisher.Config{Notify: true})
	require.NoError(t, err)
	require.Len(t, withNotify.Args, nArgs+1)

	tx := begin(t, db, nil)
	pub, err := publisher.New(tx, cfg, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", ms...))
	require.NoError(t, tx.Commit())
	var prev int64
	for _, m := range ms {
		r := readRow(t, db, m.UUID)
		require.Greater(t, r.Seq, prev, "rows keep the order of the call")
		prev = r.Seq
		require.Equal(t, []byte(m.Payload), r.Payload)
		require.Empty(t, r.Producer)
		switch string(m.Payload) {
		case "min":
			require.Equal(t, map[string]string{"x-app": "v"}, r.Headers)
			require.Empty(t, r.CorrelationID)
			require.True(t, r.OccurredAt.IsZero())
			require.Nil(t, r.AggregateVersion)
		case "common":
			require.Equal(t, "corr", r.CorrelationID)
			require.True(t, occurred.Equal(r.OccurredAt))
			require.Nil(t, r.AggregateVersion)
			require.Empty(t, r.AggregateType)
		case "full":
			require.Equal(t, "Order", r.AggregateType)
			require.Equal(t, "7", r.AggregateID)
			require.NotNil(t, r.AggregateVersion)
			require.Equal(t, int64(3), *r.AggregateVersion)
			require.Empty(t, r.CorrelationID)
		}
	}
}

// The statement text depends on which optional fields are set, never on
// their values: two different messages of the same shape share one text.
func TestStatementTextDependsOnlyOnTheFieldsSet(t *testing.T) {
	a, b := newMsg(t, "a"), newMsg(t, "b")
	envelope.SetCorrelationID(a, "one")
	envelope.SetCorrelationID(b, "two'; DROP TABLE x; --")
	sa, err := publisher.BuildInsert("t", []*message.Message{a}, publisher.Config{})
	require.NoError(t, err)
	sb, err := publisher.BuildInsert("t", []*message.Message{b}, publisher.Config{})
	require.NoError(t, err)
	require.Equal(t, sa.SQL, sb.SQL)
	require.NotContains(t, sb.SQL, "DROP")
	plain, err := publisher.BuildInsert("t", []*message.Message{newMsg(t, "c")}, publisher.Config{})
	require.NoError(t, err)
	require.NotEqual(t, sa.SQL, plain.SQL, "a message without a correlation id uses the narrower statement")
	withProducer, err := publisher.BuildInsert("t", []*message.Message{newMsg(t, "c")}, publisher.Config{Producer: "svc"})
	require.NoError(t, err)
	require.Equal(t, sa.SQL, withProducer.SQL, "Config.Producer fills a column of the common set")
}

// lib/pq's binary_parameters=yes (one round trip per statement instead of
// two) sends []byte parameters in binary; every statement variant still
// stores the same rows in that mode.
func TestPublishWithBinaryParameters(t *testing.T) {
	s := newSchema(t)
	sep := "?"
	if strings.Contains(s.URL, "?") {
		sep = "&"
	}
	db, err := sql.Open("postgres", s.URL+sep+"binary_parameters=yes")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(2)
	for _, n := range []int{1, 3} {
		for _, shape := range []string{"minimal", "common", "full"} {
			ms := msgs(t, n)
			switch shape {
			case "common":
				envelope.SetCorrelationID(ms[0], "corr")
			case "full":
				envelope.SetAggregate(ms[0], "Order", "1", 5)
			}
			tx := begin(t, db, nil)
			pub, err := publisher.New(tx, publisher.Config{Notify: true}, nil)
			require.NoError(t, err)
			require.NoError(t, pub.Publish("orders", ms...), "%d %s", n, shape)
			require.NoError(t, tx.Commit())
			for _, m := range ms {
				r := readRow(t, s.DB, m.UUID)
				require.Equal(t, []byte("m"), r.Payload)
			}
			r := readRow(t, s.DB, ms[0].UUID)
			switch shape {
			case "common":
				require.Equal(t, "corr", r.CorrelationID)
			case "full":
				require.Equal(t, int64(5), *r.AggregateVersion)
			}
		}
	}
}

// A batch carries its payloads end to end in one bytea and the server cuts
// them apart by start and length: every payload must come back byte for
// byte, whatever its size (empty, one byte, every byte value, 300 KB) and
// wherever it sits in the batch, prepared or not.
func TestBatchPayloadsComeBackExactly(t *testing.T) {
	every := make([]byte, 256)
	for i := range every {
		every[i] = byte(i)
	}
	big := make([]byte, 300<<10)
	for i := range big {
		big[i] = byte(i * 7)
	}
	payloads := [][]byte{{}, every, {0}, big, []byte(`\x00"{}'`), {}, every[:255]}
	s := newSchema(t)
	prep, err := publisher.Prepare(context.Background(), s.DB)
	require.NoError(t, err)
	t.Cleanup(func() { _ = prep.Close() })
	for _, cfg := range []publisher.Config{{}, {Prepared: prep}} {
		ms := make([]*message.Message, len(payloads))
		for i, p := range payloads {
			ms[i] = message.NewMessage(fmt.Sprintf("p%d-%s", i, randomID(t)), p)
		}
		tx := begin(t, s.DB, nil)
		pub, err := publisher.New(tx, cfg, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders", ms...))
		require.NoError(t, tx.Commit())
		for i, m := range ms {
			require.Equal(t, payloads[i], readRow(t, s.DB, m.UUID).Payload, "payload %d (prepared %v)", i, cfg.Prepared != nil)
		}
	}
}

func TestBuildInsertIsOneFixedStatement(t *testing.T) {
	one, err := publisher.BuildInsert("t", msgs(t, 1), publisher.Config{})
	require.NoError(t, err)
	two, err := publisher.BuildInsert("t", msgs(t, 2), publisher.Config{})
	require.NoError(t, err)
	many, err := publisher.BuildInsert("t", msgs(t, 500), publisher.Config{})
	require.NoError(t, err)
	require.Equal(t, two.SQL, many.SQL, "the batch statement text does not depend on the batch size")
	require.Len(t, many.Args, len(two.Args))
	require.Len(t, many.Args, len(one.Args)+2, "one message uses the VALUES form; a batch sends its payloads as one bytea plus their starts and lengths")
	require.NotEqual(t, one.SQL, two.SQL)
	require.Len(t, many.IDs, 500)
	notify, err := publisher.BuildInsert("t", msgs(t, 1), publisher.Config{Notify: true})
	require.NoError(t, err)
	require.Contains(t, notify.SQL, "pg_notify")
	require.Equal(t, publisher.DefaultNotifyChannel, notify.Args[len(notify.Args)-1])
}
