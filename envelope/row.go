package envelope

import (
	"cmp"
	"database/sql"
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
	r                                                       Row
	headers                                                 []byte
	status                                                  string
	occurred, published, nextAt, leaseExp, lastAt, parkedAt sql.NullTime
	owner, failCode, failDetail, producer, corr, caus       sql.NullString
	tenant, pkey, okey, tp, ts, bg, ssub, sver, ct, mt      sql.NullString
	aggT, aggID                                             sql.NullString
	aggV                                                    sql.NullInt64
	dest                                                    []any
}

// Scan reads the current row of s. It returns the same as [ScanRow].
func (rs *RowScanner) Scan(s Scanner) (Row, error) {
	if rs.dest == nil {
		rs.dest = []any{&rs.r.MessageID, &rs.r.Destination, &rs.r.Payload, &rs.headers, &rs.status, &rs.r.Seq, &rs.r.CreatedAt,
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
	r.OccurredAt, r.PublishedAt, r.NextAttemptAt = rs.occurred.Time, rs.published.Time, rs.nextAt.Time
	r.LeaseExpiresAt, r.LastAttemptAt, r.ParkedAt = rs.leaseExp.Time, rs.lastAt.Time, rs.parkedAt.Time
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
	return r, err
}
