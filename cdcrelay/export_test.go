package cdcrelay

import (
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Test access to the relay's own decoding path, so a test can read the
// replication stream exactly as Run does and compare the rows it decodes.

// ReplicationConfig is the replication connection Run opens, with the session
// settings it pins.
func (r *Relay) ReplicationConfig() *pgconn.Config { return r.pc.Copy() }

// StartOptions are the START_REPLICATION options Run uses.
func (r *Relay) StartOptions() pglogrepl.StartReplicationOptions { return r.startOptions() }

// DecodeInsert is what Run turns an INSERT into before envelope.ToMessage.
func DecodeInsert(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) (envelope.Row, error) {
	return decodeInsert(rel, tuple)
}

// SQLXactStatus is the statement waitXact polls.
const SQLXactStatus = sqlXactStatus
