// Package testkit holds nothing itself: the packages below it are the test
// kits (test databases, broker fakes, span and leak checks, the chaos fleet,
// the suites that prove a document), used by tests and commands only. The
// runtime helpers that library packages use sit beside it in internal/
// (pgtext, pgerr, redact, stmtset). layers_test.go, at the repository root,
// fails if a library package imports a test kit or an import points up.
package testkit
