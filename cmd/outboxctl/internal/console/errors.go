package console

import outbox "github.com/fencedoutbox/watermill-outbox"

// Codes of the console's own refusals (docs/ERRORS.md). Each is shown on
// the page that refused, with an HTTP status, and logged.
const (
	// CodeSignInFailed: the database refused the login and password (or the
	// connection): the page never says which, so it cannot be used to
	// probe for logins. HTTP 401.
	CodeSignInFailed outbox.Code = "CONSOLE_SIGN_IN_FAILED"
	// CodeSignInRateLimited: too many failed sign-ins from this address or
	// for this login within the window; every attempt is refused, a right
	// password too, until the window passes. HTTP 429 with Retry-After.
	CodeSignInRateLimited outbox.Code = "CONSOLE_SIGN_IN_RATE_LIMITED"
	// CodeSessionRequired: no session, or one that expired (idle or
	// absolute lifetime) or was signed out; its pool is closed. HTTP 401 for
	// a state-changing request, a redirect to the sign-in page otherwise.
	CodeSessionRequired outbox.Code = "CONSOLE_SESSION_REQUIRED"
	// CodeCSRF: a state-changing request without the session's CSRF token
	// (or with another one), or from another origin. HTTP 403.
	CodeCSRF outbox.Code = "CONSOLE_CSRF_REFUSED"
	// CodeReadOnly: a state-changing request to a console started with
	// --read-only. HTTP 403.
	CodeReadOnly outbox.Code = "CONSOLE_READ_ONLY"
	// CodeSelfApproval: the login that planned a ticket tried to approve
	// it. HTTP 403. (The grants refuse it too where operators hold no
	// INSERT on messaging_admin_approval; this holds for a login with both.)
	CodeSelfApproval outbox.Code = "CONSOLE_SELF_APPROVAL"
	// CodeUnknownTicket: approve of a ticket this console holds no plan for
	// (plans wait in the console's memory until approved; plan it again),
	// or a malformed ticket. HTTP 404.
	CodeUnknownTicket outbox.Code = "CONSOLE_UNKNOWN_TICKET"
	// CodeBadRequest: a filter, cursor or form value that does not parse.
	// HTTP 400.
	CodeBadRequest outbox.Code = "CONSOLE_BAD_REQUEST"
	// CodeInvalidConfig: console.Config refused (no database URL, a URL
	// that is not a postgres:// URL, TLS half configured, bad durations).
	CodeInvalidConfig outbox.Code = "CONSOLE_INVALID_CONFIG"
)
