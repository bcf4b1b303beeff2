package envelope

import (
	"regexp"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// tenantPattern is the same rule as the messaging_outbox_tenant_check
// constraint; keep the two identical.
var tenantPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)

// ValidateTenant returns an OUTBOX_INVALID_TENANT error unless tenant is a
// valid slug: lower-case ASCII letters and digits, then up to 63 more of those
// or '.', '_', '-'.
func ValidateTenant(tenant string) error {
	if !tenantPattern.MatchString(tenant) {
		return outbox.Errorf(outbox.CodeInvalidTenant, "envelope", "tenant %q must match ^[a-z0-9][a-z0-9._-]{0,63}$", tenant)
	}
	return nil
}
