package badinput_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/v2"
	"cloud.google.com/go/pubsub/v2/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/v2/pstest"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/lib/pq"
	"github.com/stretchr/testify/require"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
)

const topic = "orders"

func newSchema(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(4)
	return s
}

func good() *message.Message { return message.NewMessage(watermill.NewUUID(), []byte(`{"ok":true}`)) }

// refusedBesideGood publishes a good message, then the bad call, then a
// second good message in one transaction and commits: the bad call is
// refused with want and writes nothing, and both good rows are stored.
func refusedBesideGood(t *testing.T, want *outbox.Error, bad ...*message.Message) {
	t.Helper()
	s := newSchema(t)
	g1, g2 := good(), good()
	err := publisher.InTx(context.Background(), s.DB, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		require.NoError(t, pub.Publish(topic, g1))
		err := pub.Publish(topic, bad...)
		require.ErrorIs(t, err, want)
		require.Equal(t, want.Code, outbox.CodeOf(err))
		return pub.Publish(topic, g2)
	})
	require.NoError(t, err)
	require.Equal(t, 2, s.Count(t, ""), "only the two good rows are stored")
	require.Equal(t, 2, s.Count(t, "message_id = ANY($1)", pq.Array([]string{g1.UUID, g2.UUID})))
}

func withMeta(k, v string) *message.Message {
	m := good()
	m.Metadata.Set(k, v)
	return m
}

func TestEmptyMessageID(t *testing.T) {
	refusedBesideGood(t, outbox.ErrMessageIDRequired, message.NewMessage("", []byte("x")))
}

func TestOversizedMessageID(t *testing.T) {
	refusedBesideGood(t, outbox.ErrMessageIDTooLong, message.NewMessage(strings.Repeat("a", envelope.MaxMessageIDLength+1), []byte("x")))
}

func TestDuplicateMessageIDInOneCall(t *testing.T) {
	m := good()
	refusedBesideGood(t, outbox.ErrDuplicateMessageID, m, good(), m.Copy())
}

func TestNULInHeaderValue(t *testing.T) {
	refusedBesideGood(t, outbox.ErrInvalidHeader, withMeta("note", "a\x00b"))
}

func TestNULInHeaderKey(t *testing.T) {
	refusedBesideGood(t, outbox.ErrInvalidHeader, withMeta("no\x00te", "v"))
}

func TestNonUTF8HeaderBytes(t *testing.T) {
	refusedBesideGood(t, outbox.ErrInvalidHeader, withMeta("note", "caf\xe9"))
}

func TestReservedHeaderKey(t *testing.T) {
	refusedBesideGood(t, outbox.ErrReservedHeader, withMeta("msg.bogus", "v"))
}

func TestInvalidTenant(t *testing.T) {
	m := good()
	envelope.SetTenant(m, "Not A Slug!")
	refusedBesideGood(t, outbox.ErrInvalidTenant, m)
}

// A duplicate across calls is only visible to the database (the primary
// key). PostgreSQL aborts the transaction on the failed statement: the
// caller gets OUTBOX_DUPLICATE_MESSAGE_ID and must roll back; the first
// transaction's row is untouched and nothing of the second is stored.
func TestDuplicateMessageIDAcrossCalls(t *testing.T) {
	s := newSchema(t)
	m := good()
	require.NoError(t, publisher.InTx(context.Background(), s.DB, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish(topic, m)
	}))
	other := good()
	err := publisher.InTx(context.Background(), s.DB, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		require.NoError(t, pub.Publish(topic, other))
		dup := message.NewMessage(m.UUID, []byte("different payload"))
		return pub.Publish(topic, dup)
	})
	require.ErrorIs(t, err, outbox.ErrDuplicateMessageID)
	require.Equal(t, 1, s.Count(t, ""))
	var payload []byte
	require.NoError(t, s.DB.QueryRow(`SELECT payload FROM messaging_outbox WHERE message_id = $1`, m.UUID).Scan(&payload))
	require.Equal(t, m.Payload, message.Payload(payload), "the stored row is the first one")
}

func TestFinishedTransaction(t *testing.T) {
	s := newSchema(t)
	for _, finish := range []func(*sql.Tx) error{(*sql.Tx).Commit, (*sql.Tx).Rollback} {
		tx, err := s.DB.Begin()
		require.NoError(t, err)
		pub, err := publisher.New(tx, publisher.Config{}, nil)
		require.NoError(t, err)
		require.NoError(t, finish(tx))
		require.ErrorIs(t, pub.Publish(topic, good()), outbox.ErrTransactionRequired)
	}
	_, err := publisher.New(nil, publisher.Config{}, nil)
	require.ErrorIs(t, err, outbox.ErrTransactionRequired)
	require.Zero(t, s.Count(t, ""))
}

func TestReadOnlyTransaction(t *testing.T) {
	s := newSchema(t)
	tx, err := s.DB.BeginTx(context.Background(), &sql.TxOptions{ReadOnly: true})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	require.ErrorIs(t, pub.Publish(topic, good()), outbox.ErrTransactionRequired)
	require.Zero(t, s.Count(t, ""))
}

func TestConfigViolatingInvariants(t *testing.T) {
	s := newSchema(t)
	ch := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer ch.Close()
	for _, tc := range []struct {
		name string
		cfg  forwarder.Config
		want *outbox.Error
	}{
		{"lease shorter than 2 x publish timeout", forwarder.Config{LeaseDuration: time.Second, PublishTimeout: time.Second}, outbox.ErrLeaseTooShort},
		{"negative batch size", forwarder.Config{BatchSize: -1}, outbox.ErrInvalidConfig},
		{"negative max attempts", forwarder.Config{MaxAttempts: -3}, outbox.ErrInvalidConfig},
		{"backoff max below base", forwarder.Config{BackoffBase: time.Minute, BackoffMax: time.Second}, outbox.ErrInvalidConfig},
		{"drain past the lease", forwarder.Config{LeaseDuration: 10 * time.Second, PublishTimeout: time.Second, DrainTimeout: 10 * time.Second}, outbox.ErrInvalidConfig},
		{"owner with NUL", forwarder.Config{Owner: "a\x00b"}, outbox.ErrInvalidConfig},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorIs(t, tc.cfg.Validate(), tc.want)
			_, err := forwarder.New(s.DB, ch, nil, tc.cfg)
			require.ErrorIs(t, err, tc.want)
		})
	}
	require.ErrorIs(t, publisher.Config{NotifyChannel: strings.Repeat("c", 64)}.Validate(), outbox.ErrInvalidConfig)
	require.ErrorIs(t, publisher.Config{Producer: "bad\xff"}.Validate(), outbox.ErrInvalidConfig)
	_, err := forwarder.New(s.DB, nil, nil, forwarder.Config{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

// ---- relay path: rows that get into the table anyway ----

// Raw SQL bypasses the publisher; this is what a hand-written INSERT, a
// restored backup or another tool can leave behind.
const insertRaw = `INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ($1, $2, $3, $4::jsonb)`

func insertGood(t *testing.T, db *sql.DB, topic string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range n {
		msgs[i] = good()
		ids[i] = msgs[i].UUID
	}
	require.NoError(t, publisher.InTx(context.Background(), db, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish(topic, msgs...)
	}))
	return ids
}

func statusOf(t *testing.T, db *sql.DB, id string) (status, code string) {
	t.Helper()
	var c sql.NullString
	require.NoError(t, db.QueryRow(`SELECT status, last_failure_code FROM messaging_outbox WHERE message_id = $1`, id).Scan(&status, &c))
	return status, c.String
}

func runOnce(t *testing.T, db *sql.DB, out message.Publisher, cfg forwarder.Config) forwarder.Report {
	t.Helper()
	cfg.BatchSize = 50
	f, err := forwarder.New(db, out, nil, cfg)
	require.NoError(t, err)
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	return rep
}

func TestCorruptStoredRowsAreParkedAndTheRestOfTheBatchPublished(t *testing.T) {
	s := newSchema(t)
	before := insertGood(t, s.DB, topic, 2)
	corrupt := map[string]string{
		"headers-number":    `{"a": 1}`,
		"headers-nested":    `{"a": {"b": "c"}}`,
		"headers-reserved":  `{"msg.bogus": "x"}`,
		"headers-canonical": `{"msg.tenant": "acme"}`,
	}
	for id, h := range corrupt {
		_, err := s.DB.Exec(insertRaw, id, topic, []byte("x"), h)
		require.NoError(t, err, id)
	}
	after := insertGood(t, s.DB, topic, 2)

	ch := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer ch.Close()
	rep := runOnce(t, s.DB, ch, forwarder.Config{})
	require.Equal(t, 4, rep.Published)
	require.Equal(t, len(corrupt), rep.Failed)
	for id := range corrupt {
		st, code := statusOf(t, s.DB, id)
		require.Equal(t, string(envelope.StatusFailed), st, id)
		require.Contains(t, []string{string(outbox.CodeCorruptRow), string(outbox.CodeReservedHeader)}, code, id)
	}
	for _, id := range append(before, after...) {
		st, _ := statusOf(t, s.DB, id)
		require.Equal(t, string(envelope.StatusPublished), st)
	}
	// Parked means parked: another pass does not pick them up again.
	rep = runOnce(t, s.DB, ch, forwarder.Config{})
	require.Zero(t, rep.Claimed)
}

func TestSchemaRefusesUnknownStatusAndNonObjectHeaders(t *testing.T) {
	s := newSchema(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, status) VALUES ('x', 't', '\x00', 'DONE')`)
	var pqErr *pq.Error
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, "23514", string(pqErr.Code), "check_violation: %v", err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, tenant) VALUES ('y', 't', '\x00', 'Bad Tenant')`)
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, "23514", string(pqErr.Code))
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ('z', 't', '\x00', '[1, 2]')`)
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, "23514", string(pqErr.Code), "headers not an object: %v", err)
	require.Equal(t, "messaging_outbox_headers_object", pqErr.Constraint)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload) VALUES ('', 't', '\x00')`)
	require.ErrorAs(t, err, &pqErr)
	require.Equal(t, "23514", string(pqErr.Code), "empty message id: %v", err)
	require.Zero(t, s.Count(t, ""))
}

// ---- relay path: a downstream with real limits (pstest + the client library) ----

const project = "badinput"

func pubsubPublisher(t *testing.T, topics ...string) message.Publisher {
	t.Helper()
	srv := pstest.NewServer()
	t.Cleanup(func() { _ = srv.Close() })
	dial := func() []option.ClientOption {
		conn, err := grpc.NewClient(srv.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		return []option.ClientOption{option.WithGRPCConn(conn)}
	}
	client, err := pubsub.NewClient(context.Background(), project, dial()...)
	require.NoError(t, err)
	for _, tp := range topics {
		_, err := client.TopicAdminClient.CreateTopic(context.Background(), &pubsubpb.Topic{Name: "projects/" + project + "/topics/" + tp})
		require.NoError(t, err)
	}
	require.NoError(t, client.Close())
	pub, err := googlecloud.NewPublisher(googlecloud.Config{ProjectID: project, ClientOptions: dial(), PublishTimeout: 5 * time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func TestHugePayloadAtTheDownstreamLimitIsFailedNotRetried(t *testing.T) {
	s := newSchema(t)
	before := insertGood(t, s.DB, topic, 2)
	huge := message.NewMessage(watermill.NewUUID(), make([]byte, pubsub.MaxPublishRequestBytes+1))
	require.NoError(t, publisher.InTx(context.Background(), s.DB, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish(topic, huge)
	}))
	after := insertGood(t, s.DB, topic, 2)

	out := pubsubPublisher(t, topic)
	cfg := forwarder.Config{Classifier: googlecloud.Classify, PublishTimeout: 10 * time.Second}
	// The huge row is over the claim's byte budget (MaxBatchBytes, 8 MiB):
	// the first pass takes the rows before it, the next the huge row alone,
	// the last the rows after it.
	var published, failed []int
	for {
		rep := runOnce(t, s.DB, out, cfg)
		if rep.Claimed == 0 {
			break
		}
		published, failed = append(published, rep.Published), append(failed, rep.Failed)
	}
	require.Equal(t, []int{2, 0, 2}, published)
	require.Equal(t, []int{0, 1, 0}, failed)
	st, code := statusOf(t, s.DB, huge.UUID)
	require.Equal(t, string(envelope.StatusFailed), st)
	require.Equal(t, googlecloud.CodeMessageTooLarge, code)
	for _, id := range append(before, after...) {
		st, _ := statusOf(t, s.DB, id)
		require.Equal(t, string(envelope.StatusPublished), st)
	}
	rep := runOnce(t, s.DB, out, cfg)
	require.Zero(t, rep.Claimed, "a FAILED row is not retried")
}

func TestTopicTheDownstreamRefusesIsFailed(t *testing.T) {
	s := newSchema(t)
	good1 := insertGood(t, s.DB, topic, 2)
	refused := insertGood(t, s.DB, "no-such-topic", 1)
	good2 := insertGood(t, s.DB, topic, 2)

	out := pubsubPublisher(t, topic)
	rep := runOnce(t, s.DB, out, forwarder.Config{Classifier: googlecloud.Classify})
	require.Equal(t, 4, rep.Published)
	require.Equal(t, 1, rep.Failed)
	st, code := statusOf(t, s.DB, refused[0])
	require.Equal(t, string(envelope.StatusFailed), st)
	require.Equal(t, googlecloud.CodeTopicNotFound, code)
	for _, id := range append(good1, good2...) {
		st, _ := statusOf(t, s.DB, id)
		require.Equal(t, string(envelope.StatusPublished), st)
	}
}
