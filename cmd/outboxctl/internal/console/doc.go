// Package console is the operator web console `outboxctl console` serves
// (docs/CONSOLE.md): server-rendered pages (html/template, SVG charts drawn
// on the server, one embedded stylesheet, no script) over the status,
// journal and relaymode packages.
//
// What it guarantees, each shown by a test of this package:
//
//   - Identity is the database's: a person signs in with a PostgreSQL login
//     and password, the console opens a pool of their own with them (kept in
//     memory, closed at sign-out or expiry) and every query and action runs
//     on it, so grants decide what each person sees and does, and the journal
//     records their login.
//   - Actions go through the journal as `outboxctl redrive|purge` does:
//     plans are the journal's dry runs, approvals journal.Approve (refused to
//     the login that planned the ticket), executions need the recorded
//     approval and run once.
//   - Sessions expire (idle and absolute), sign-in failures are rate-limited
//     per address and per login, every state-changing request carries the
//     session's CSRF token, every answer a Content-Security-Policy without
//     inline script or style, and no page, log line or error a password.
//   - Application text (ids, topics, headers, payloads, failure details) is
//     shown as text: control characters escaped, markup escaped.
//   - The console's own queries on messaging_outbox are served by indexes
//     (EXPLAIN in the tests); the overview's aggregates are read at most once
//     per Config.OverviewMaxAge per session, in the background.
package console
