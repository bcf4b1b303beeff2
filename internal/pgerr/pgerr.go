// Package pgerr reads a PostgreSQL refusal out of an error without naming a
// driver: lib/pq's *pq.Error and pgx's *pgconn.PgError both have
// SQLState() string, and both carry the violated constraint in a string
// field (pq: Constraint, pgconn: ConstraintName). The core classifies every
// database error through here, so a service on either driver (or any driver
// whose error type has SQLState()) gets the same typed refusals.
package pgerr

import (
	"errors"
	"reflect"
)

// SQLStates are the SQLSTATE codes the project maps.
const (
	UniqueViolation        = "23505"
	CheckViolation         = "23514"
	ReadOnlySQLTransaction = "25006"
	InFailedSQLTransaction = "25P02"
	DuplicateObject        = "42710"
	ObjectInUse            = "55006"
	UndefinedTable         = "42P01"
	QueryCanceled          = "57014"
	SerializationFailure   = "40001"
	DeadlockDetected       = "40P01"
	LockNotAvailable       = "55P03"
)

// sqlStater is what lib/pq's and pgx's error types have in common.
type sqlStater interface {
	error
	SQLState() string
}

// As returns the first error in err's chain that carries a SQLSTATE, or nil.
func As(err error) error {
	var s sqlStater
	if errors.As(err, &s) {
		return s
	}
	return nil
}

// State returns the SQLSTATE of the first database error in err's chain, or
// "" when there is none.
func State(err error) string {
	var s sqlStater
	if errors.As(err, &s) {
		return s.SQLState()
	}
	return ""
}

// Is reports whether err's chain holds a database error with SQLSTATE code.
func Is(err error, code string) bool {
	return code != "" && State(err) == code
}

// constraintNamer lets a driver other than lib/pq and pgx name the
// constraint with a method.
type constraintNamer interface{ ConstraintName() string }

// Constraint returns the name of the constraint the database error in err's
// chain violated, or "" when it names none. It reads the method
// ConstraintName() when the error has one, else a string field named
// ConstraintName (pgconn.PgError) or Constraint (pq.Error).
func Constraint(err error) string {
	s, ok := As(err).(sqlStater)
	if !ok {
		return ""
	}
	if c, ok := s.(constraintNamer); ok {
		return c.ConstraintName()
	}
	v := reflect.ValueOf(s)
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return ""
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct {
		return ""
	}
	for _, name := range [...]string{"ConstraintName", "Constraint"} {
		if f := v.FieldByName(name); f.IsValid() && f.Kind() == reflect.String {
			return f.String()
		}
	}
	return ""
}

// Violates reports whether err is a refusal with SQLSTATE code by the
// constraint named constraint.
func Violates(err error, code, constraint string) bool {
	return Is(err, code) && Constraint(err) == constraint
}
