package fencing_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// Claim's doc: invalid parameters are refused with FENCING_INVALID_ARGUMENT
// before touching the database. With no database at all (a nil DBTX) every
// refusal must still come back as that error, not as a nil dereference.
func TestClaimRefusesInvalidParametersWithoutTheDatabase(t *testing.T) {
	good := params("r", t0)
	for name, mut := range map[string]func(*fencing.ClaimParams){
		"empty owner":      func(p *fencing.ClaimParams) { p.Owner = "" },
		"zero limit":       func(p *fencing.ClaimParams) { p.Limit = 0 },
		"negative limit":   func(p *fencing.ClaimParams) { p.Limit = -1 },
		"zero lease":       func(p *fencing.ClaimParams) { p.Lease = 0 },
		"negative lease":   func(p *fencing.ClaimParams) { p.Lease = -1 },
		"zero attempts":    func(p *fencing.ClaimParams) { p.MaxAttempts = 0 },
		"negative attempt": func(p *fencing.ClaimParams) { p.MaxAttempts = -1 },
		"unknown policy":   func(p *fencing.ClaimParams) { p.Policy = 7 },
		"negative from":    func(p *fencing.ClaimParams) { p.FromSeq = -1 },
	} {
		t.Run(name, func(t *testing.T) {
			p := good
			mut(&p)
			var db fencing.DBTX // nil: any use of it would panic
			var err error
			require.NotPanics(t, func() { _, err = fencing.Claim(context.Background(), db, p) })
			require.ErrorIs(t, err, fencing.ErrInvalidArgument)
			require.Equal(t, fencing.CodeInvalidArgument, outbox.CodeOf(err))
		})
	}
}
