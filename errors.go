package outbox

import (
	"errors"
	"fmt"
)

// Code is a stable, machine-readable error code. Codes never change meaning
// once released; match on them (or on the sentinel errors below) rather than
// on error strings.
type Code string

// Codes shared by the write path. Packages that own other refusals (journal,
// debezium, forwarder) declare their codes beside the calls that return them.
const (
	CodeTransactionRequired Code = "OUTBOX_TRANSACTION_REQUIRED" // nil, finished or read-only *sql.Tx
	CodePublisherClosed     Code = "OUTBOX_PUBLISHER_CLOSED"     // Publish after Close
	CodeTopicRequired       Code = "OUTBOX_TOPIC_REQUIRED"       // empty topic
	CodeMessageIDRequired   Code = "OUTBOX_MESSAGE_ID_REQUIRED"  // empty msg.UUID
	CodeMessageIDTooLong    Code = "OUTBOX_MESSAGE_ID_TOO_LONG"  // msg.UUID longer than MaxMessageIDLength
	CodeDuplicateMessageID  Code = "OUTBOX_DUPLICATE_MESSAGE_ID" // same id twice in one call, or already in the table
	CodeReservedHeader      Code = "OUTBOX_RESERVED_HEADER"      // unknown key in the msg.* namespace
	CodeInvalidHeader       Code = "OUTBOX_INVALID_HEADER"       // NUL byte, invalid UTF-8, or a value PostgreSQL text cannot hold
	CodeInvalidTenant       Code = "OUTBOX_INVALID_TENANT"       // tenant slug fails the schema rule
	CodeInvalidMetadata     Code = "OUTBOX_INVALID_METADATA"     // a canonical field with an unparsable value
	CodeCorruptRow          Code = "OUTBOX_CORRUPT_ROW"          // a stored row the envelope cannot turn back into a message
	CodeInvalidConfig       Code = "OUTBOX_INVALID_CONFIG"       // a configuration that violates an invariant
	CodeLeaseTooShort       Code = "OUTBOX_LEASE_TOO_SHORT"      // lease shorter than 2 x publish timeout
)

// Error is the typed error every package of this module returns for a refusal.
// errors.Is(err, target) matches any *Error with the same Code, so the
// sentinels below (and any package's own sentinels) work with errors.Is, and
// errors.As(err, &e) gives access to the code, the operation and the detail.
type Error struct {
	Code   Code   // stable code
	Op     string // the call that refused, e.g. "publisher.Publish"
	Detail string // what was wrong and what to change
	Err    error  // underlying cause, if any
}

func (e *Error) Error() string {
	msg := string(e.Code)
	if e.Op != "" {
		msg = e.Op + ": " + msg
	}
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

func (e *Error) Unwrap() error { return e.Err }

// Is reports whether target is an *Error with the same code.
func (e *Error) Is(target error) bool {
	var t *Error
	if errors.As(target, &t) {
		return t.Code == e.Code
	}
	return false
}

// Errorf builds an *Error with a formatted detail.
func Errorf(code Code, op, format string, args ...any) *Error {
	return &Error{Code: code, Op: op, Detail: fmt.Sprintf(format, args...)}
}

// Wrap builds an *Error around a cause.
func Wrap(code Code, op string, cause error, detail string) *Error {
	return &Error{Code: code, Op: op, Detail: detail, Err: cause}
}

// CodeOf returns the code of the first *Error in err's chain, or "".
func CodeOf(err error) Code {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

// Sentinels for errors.Is.
var (
	ErrTransactionRequired = &Error{Code: CodeTransactionRequired}
	ErrPublisherClosed     = &Error{Code: CodePublisherClosed}
	ErrTopicRequired       = &Error{Code: CodeTopicRequired}
	ErrMessageIDRequired   = &Error{Code: CodeMessageIDRequired}
	ErrMessageIDTooLong    = &Error{Code: CodeMessageIDTooLong}
	ErrDuplicateMessageID  = &Error{Code: CodeDuplicateMessageID}
	ErrReservedHeader      = &Error{Code: CodeReservedHeader}
	ErrInvalidHeader       = &Error{Code: CodeInvalidHeader}
	ErrInvalidTenant       = &Error{Code: CodeInvalidTenant}
	ErrInvalidMetadata     = &Error{Code: CodeInvalidMetadata}
	ErrCorruptRow          = &Error{Code: CodeCorruptRow}
	ErrInvalidConfig       = &Error{Code: CodeInvalidConfig}
	ErrLeaseTooShort       = &Error{Code: CodeLeaseTooShort}
)
