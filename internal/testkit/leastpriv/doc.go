// Package leastpriv holds the test that proves docs/SECURITY.md: every
// component runs under a login holding exactly the grants the page lists.
package leastpriv
