package envelope

import (
	"cmp"
	"database/sql"
	"fmt"
	"time"
)

// Status is a row's lifecycle state (the status column).
type Status string

// The states of a row. See the package documentation for the transitions.
const (
	StatusPending   Status = "PENDING"
	StatusInFlight  Status = "IN_FLIGHT"
	StatusPublished Status = "PUBLISHED"
	StatusAmbiguous Status = "AMBIGUOUS"
	StatusFailed    Status = "FAILED"
	StatusExhausted Status = "EXHAUSTED"
)

// Valid reports whether s is one of the six states the schema allows.
func (s Status) Valid() bool {
	switch s {
	case StatusPending, StatusInFlight, StatusPublished, StatusAmbiguous, StatusFailed, StatusExhausted:
		return true
	}
	return false
}

// Parked reports whether s is a parked state (redrive only).
func (s Status) Parked() bool { return s == StatusFailed || s == StatusExhausted }

// Row is one messaging_outbox row. Text columns use "" for NULL and time
// columns the zero time, so an absent value is never stored as an empty
// string.
type Row struct {
	MessageID         string
	Destination       string
	Payload           []byte
	Headers           map[string]string
	Status            Status
	Seq               int64
	CreatedAt         time.Time
	OccurredAt        time.Time
	PublishedAt       time.Time
	Attempts          int
	NextAttemptAt     time.Time
	LeaseOwner        string
	LeaseToken        int64
	LeaseExpiresAt    time.Time
	LastFailureCode   string
	LastFailureDetail string
	LastAttemptAt     time.Time
	Producer          string
	CorrelationID     string
	CausationID       string
	Tenant            string
	PartitionKey      string
	OrderingKey       string
	Traceparent       string
	Tracestate        string
	Baggage           string
	SchemaSubject     string
	SchemaVersion     string
	ContentType       string
	MessageType       string
	AggregateType     string
	AggregateID       string
	AggregateVersion  *int64
	ParkedAt          time.Time
	RoutingKey        string // generated: PartitionKey when set, else MessageID
}

// DownstreamKey is the row's routing key: the stored routing_key when the row
// was read back, else the generated column's rule (PartitionKey when set, else
// MessageID), for rows built in memory.
func (r Row) DownstreamKey() string { return cmp.Or(r.RoutingKey, r.PartitionKey, r.MessageID) }

// SelectColumns is the column list, in Row field order, that [ScanRow] reads.
// Prefix-free, so callers qualify it only where their query needs to.
const SelectColumns = `message_id, destination, payload, headers, status, seq, created_at,
occurred_at, published_at, attempts, next_attempt_at, lease_owner, lease_token,
lease_expires_at, last_failure_code, last_failure_detail, last_attempt_at, producer,
correlation_id, causation_id, tenant, partition_key, ordering_key, traceparent,
tracestate, baggage, schema_subject, schema_version, content_type, message_type,
aggregate_type, aggregate_id, aggregate_version, parked_at, routing_key`

// Scanner is satisfied by *sql.Row and *sql.Rows.
type Scanner interface{ Scan(dest ...any) error }

// ScanRow reads one row selected with [SelectColumns]. A row whose headers
// are not a flat string object, or whose status is unknown, is returned with
// an OUTBOX_CORRUPT_ROW error (the identity fields are filled so the caller
// can park it).
func ScanRow(s Scanner) (Row, error) {
	var rs RowScanner
	return rs.Scan(s)
}

// RowScanner reads rows selected with [SelectColumns] like [ScanRow], but
// keeps its scan destinations between rows: reading a result set with one
// RowScanner allocates them once instead of once per row. The zero value is
// ready to use; it is not safe for concurrent use.
type RowScanner struct {
	r                                                                Row
	headers                                                          []byte
	status                                                           string
	created, occurred, published, nextAt, leaseExp, lastAt, parkedAt stamp
	owner, failCode, failDetail, producer, corr, caus                sql.NullString
	tenant, pkey, okey, tp, ts, bg, ssub, sver, ct, mt               sql.NullString
	aggT, aggID                                                      sql.NullString
	aggV                                                             sql.NullInt64
	dest                                                             []any
}

// Scan reads the current row of s. It returns the same as [ScanRow].
func (rs *RowScanner) Scan(s Scanner) (Row, error) {
	if rs.dest == nil {
		rs.dest = []any{&rs.r.MessageID, &rs.r.Destination, &rs.r.Payload, &rs.headers, &rs.status, &rs.r.Seq, &rs.created,
			&rs.occurred, &rs.published, &rs.r.Attempts, &rs.nextAt, &rs.owner, &rs.r.LeaseToken,
			&rs.leaseExp, &rs.failCode, &rs.failDetail, &rs.lastAt, &rs.producer,
			&rs.corr, &rs.caus, &rs.tenant, &rs.pkey, &rs.okey, &rs.tp,
			&rs.ts, &rs.bg, &rs.ssub, &rs.sver, &rs.ct, &rs.mt,
			&rs.aggT, &rs.aggID, &rs.aggV, &rs.parkedAt, &rs.r.RoutingKey}
	}
	// Scan assigns every destination, or fails: nothing of a previous row
	// survives into this one. The payload is a fresh copy each time (Scan
	// into *[]byte copies), so returned rows never share it.
	if err := s.Scan(rs.dest...); err != nil {
		return Row{}, err
	}
	r := rs.r
	r.Status = Status(rs.status)
	r.CreatedAt, r.OccurredAt, r.PublishedAt, r.NextAttemptAt = rs.created.t, rs.occurred.t, rs.published.t, rs.nextAt.t
	r.LeaseExpiresAt, r.LastAttemptAt, r.ParkedAt = rs.leaseExp.t, rs.lastAt.t, rs.parkedAt.t
	r.LeaseOwner, r.LastFailureCode, r.LastFailureDetail = rs.owner.String, rs.failCode.String, rs.failDetail.String
	r.Producer, r.CorrelationID, r.CausationID, r.Tenant = rs.producer.String, rs.corr.String, rs.caus.String, rs.tenant.String
	r.PartitionKey, r.OrderingKey = rs.pkey.String, rs.okey.String
	r.Traceparent, r.Tracestate, r.Baggage = rs.tp.String, rs.ts.String, rs.bg.String
	r.SchemaSubject, r.SchemaVersion, r.ContentType, r.MessageType = rs.ssub.String, rs.sver.String, rs.ct.String, rs.mt.String
	r.AggregateType, r.AggregateID = rs.aggT.String, rs.aggID.String
	if rs.aggV.Valid {
		v := rs.aggV.Int64
		r.AggregateVersion = &v
	}
	var err error
	r.Headers, err = DecodeHeaders(rs.headers)
	if err == nil && !r.Status.Valid() {
		err = corrupt("status %q is not a known state", rs.status)
	}
	for _, c := range []struct {
		name string
		st   *stamp
	}{{"created_at", &rs.created}, {"occurred_at", &rs.occurred}, {"published_at", &rs.published},
		{"next_attempt_at", &rs.nextAt}, {"lease_expires_at", &rs.leaseExp}, {"last_attempt_at", &rs.lastAt}, {"parked_at", &rs.parkedAt}} {
		if err == nil && c.st.bad != "" {
			err = corrupt("column %s holds %q, which is not a timestamp a message can carry", c.name, c.st.bad)
		}
	}
	return r, err
}

// stamp scans a timestamptz column without failing the row: a value the
// driver cannot turn into a time.Time (PostgreSQL's 'infinity' and
// '-infinity', which lib/pq hands over as text) is kept as text in bad, so
// that one unreadable timestamp becomes an OUTBOX_CORRUPT_ROW error for its
// row, with every other column read, instead of a scan error that loses the
// whole result set. NULL leaves the zero time.
type stamp struct {
	t   time.Time
	bad string
}

func (s *stamp) Scan(v any) error {
	s.t, s.bad = time.Time{}, ""
	switch x := v.(type) {
	case nil:
	case time.Time:
		s.t = x
	case []byte:
		return s.text(string(x))
	case string:
		return s.text(x)
	default:
		s.bad = fmt.Sprintf("%v", v)
	}
	return nil
}

func (s *stamp) text(x string) error {
	for _, layout := range []string{"2006-01-02 15:04:05.999999999Z07:00:00", "2006-01-02 15:04:05.999999999Z07:00", "2006-01-02 15:04:05.999999999Z07", time.RFC3339Nano} {
		if t, err := time.Parse(layout, x); err == nil {
			s.t = t
			return nil
		}
	}
	s.bad = x
	return nil
}
