// Package stmtset keeps prepared statements by their SQL text, for the
// packages that prepare their hot statements once per *sql.DB (fencing,
// publisher). Users never see it: they hold fencing.Prepared or
// publisher.Prepared.
package stmtset

import (
	"database/sql"
	"sync"
)

// Set is a closable map from SQL text to its prepared statement. The zero
// value is ready to use; it is safe for concurrent use.
type Set struct {
	mu     sync.Mutex
	stmts  map[string]*sql.Stmt
	closed bool
}

// Get returns the statement prepared for query (nil when there is none) and
// whether the set is closed.
func (s *Set) Get(query string) (st *sql.Stmt, closed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stmts[query], s.closed
}

// GetOrPrepare returns the statement for query, calling prepare (under the
// set's lock, so a statement is prepared once) when there is none yet. A
// failed prepare is returned and not remembered. On a closed set it returns
// nil, true and prepares nothing.
func (s *Set) GetOrPrepare(query string, prepare func() (*sql.Stmt, error)) (st *sql.Stmt, closed bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, true, nil
	}
	if st := s.stmts[query]; st != nil {
		return st, false, nil
	}
	st, err = prepare()
	if err != nil {
		return nil, false, err
	}
	if s.stmts == nil {
		s.stmts = make(map[string]*sql.Stmt)
	}
	s.stmts[query] = st
	return st, false, nil
}

// Close closes every statement (database/sql waits for the ones running)
// and marks the set closed; it returns the first error. Safe to call more
// than once.
func (s *Set) Close() error {
	s.mu.Lock()
	stmts := s.stmts
	s.stmts, s.closed = nil, true
	s.mu.Unlock()
	var first error
	for _, st := range stmts {
		if err := st.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
