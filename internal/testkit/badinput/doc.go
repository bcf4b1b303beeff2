// Package badinput holds one test per row of docs/BAD_INPUT.md: every bad
// input the outbox can meet, on the write path (the publisher refuses it
// with a typed error and writes nothing) or on the relay path (the row is
// parked FAILED with a code, never retried forever), and in each case the
// good messages beside it are unharmed.
package badinput
