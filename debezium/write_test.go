package debezium_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/debezium"
)

func TestWritePropertiesEscapesForJavaProperties(t *testing.T) {
	t.Parallel()
	var p bytes.Buffer
	require.NoError(t, debezium.Generate(debezium.Options{Name: "naïve #1", DatabasePassword: `a\b=c`}).WriteProperties(&p))
	require.Contains(t, p.String(), "\nname=na\\u00EFve #1\n")
	require.Contains(t, p.String(), "\ndatabase.password=a\\\\b=c\n")
}
