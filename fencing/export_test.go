package fencing

// The outcome statements, for the tests that run them directly (generic
// plans, the all-PUBLISHED form against the general one). They are not part
// of the API: Apply picks between them.
const (
	ApplySQL          = applySQL
	ApplyPublishedSQL = applyPublishedSQL
)
