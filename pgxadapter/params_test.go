package pgxadapter

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestStripPoolParamsKeywordValue(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		// Spaces around '=' are allowed (libpq, pgconn, pgxpool); splitting on
		// whitespace left "= 5" behind, which pgx refused.
		{"host=127.0.0.1 pool_max_conns = 5", "host=127.0.0.1"},
		{"pool_max_conns =\t5  host=127.0.0.1 dbname = test", "  host=127.0.0.1 dbname = test"},
		{"host=127.0.0.1 pool_max_conns='1 0' user=app", "host=127.0.0.1 user=app"},
		{`host=h pool_x='a\' b' port=5432`, "host=h port=5432"},
		{`host=h pool_x=a\ b port=5432`, "host=h port=5432"},
		{"host=h pool_max_conns=", "host=h"},
		{"host=h password='x'pool_min_conns=1", "host=h password='x'"},
		// Two spaces inside a quoted value used to collapse into one.
		{"host=127.0.0.1 password='a  b' pool_max_conns=5", "host=127.0.0.1 password='a  b'"},
		// Nothing to strip: the string is returned byte for byte.
		{"host=127.0.0.1  password='a  b'\tdbname = test ", "host=127.0.0.1  password='a  b'\tdbname = test "},
		{`host=h password='it\'s  \\ ok' user=app`, `host=h password='it\'s  \\ ok' user=app`},
		// Unreadable strings are left for pgx to refuse.
		{"host=h pool_max_conns", "host=h pool_max_conns"},
		{"host=h pool_x='unterminated", "host=h pool_x='unterminated"},
		{"", ""},
	} {
		require.Equal(t, c.want, stripPoolParams(c.in), "%q", c.in)
	}
	// URL form: unchanged behaviour.
	require.Equal(t, "postgres://u@h/db?sslmode=disable", stripPoolParams("postgres://u@h/db?pool_max_conns=5&sslmode=disable"))
}

func TestNewListenerKeywordValuePoolParams(t *testing.T) {
	l, err := NewListener("host=127.0.0.1 pool_max_conns = 5 user=app")
	require.NoError(t, err, "pgxpool accepts spaces around '='")
	require.Equal(t, "app", l.cfg.User)
	_, found := l.cfg.RuntimeParams["pool_max_conns"]
	require.False(t, found)

	l, err = NewListener("host=127.0.0.1 password='a  b' pool_max_conns=5")
	require.NoError(t, err)
	require.Equal(t, "a  b", l.cfg.Password, "a quoted value is kept byte for byte")

	l, err = NewListener("host=127.0.0.1 password='a  b' application_name = 'x  y'")
	require.NoError(t, err)
	require.Equal(t, "a  b", l.cfg.Password)
	require.Equal(t, "x  y", l.cfg.RuntimeParams["application_name"])
}
