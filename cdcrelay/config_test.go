package cdcrelay

import (
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

func TestConfigValidate(t *testing.T) {
	db := &sql.DB{} // never used: Validate does not connect
	ok := Config{ConnString: "postgres://u@127.0.0.1:5432/db", DB: db}
	require.NoError(t, ok.Validate())
	d := ok.withDefaults()
	require.Equal(t, "messaging_outbox_cdc", d.SlotName, "the Debezium connector's default slot too")
	require.Equal(t, 2*time.Second, d.HeartbeatInterval)
	require.Equal(t, 15*time.Second, d.HeartbeatTTL)
	require.Contains(t, d.Owner, "cdcrelay@")

	pc, err := ok.replicationConfig()
	require.NoError(t, err)
	require.Equal(t, "database", pc.RuntimeParams["replication"], "replication=database is added")
	require.Equal(t, "UTC", pc.RuntimeParams["TimeZone"])
	require.Equal(t, "hex", pc.RuntimeParams["bytea_output"])

	explicit := ok
	explicit.ConnString = "postgres://u@127.0.0.1:5432/db?replication=database"
	require.NoError(t, explicit.Validate())

	bad := map[string]func(c *Config){
		"no conn string":          func(c *Config) { c.ConnString = "" },
		"no DB":                   func(c *Config) { c.DB = nil },
		"physical replication":    func(c *Config) { c.ConnString = "postgres://u@h/db?replication=true" },
		"unparsable conn string":  func(c *Config) { c.ConnString = "postgres://u@h:notaport/db" },
		"upper-case slot":         func(c *Config) { c.SlotName = "Slot" },
		"quote in publication":    func(c *Config) { c.PublicationName = `p"x` },
		"schema with a dash":      func(c *Config) { c.Schema = "my-schema" },
		"negative standby":        func(c *Config) { c.StandbyTimeout = -time.Second },
		"negative slot busy wait": func(c *Config) { c.SlotBusyWait = -time.Second },
		"retry max below initial": func(c *Config) { c.RetryInitial, c.RetryMax = time.Minute, time.Second },
		"negative attempts":       func(c *Config) { c.MaxPublishAttempts = -1 },
		"ttl below two beats":     func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = 10*time.Second, 15*time.Second },
		"negative heartbeat":      func(c *Config) { c.HeartbeatInterval = -time.Second },
		"negative batch":          func(c *Config) { c.BatchSize = -1 },
		"blank owner":             func(c *Config) { c.Owner = "  " },
		"negative ttl":            func(c *Config) { c.HeartbeatTTL = -time.Second },
		"negative retry initial":  func(c *Config) { c.RetryInitial = -time.Second },
		"negative retry max":      func(c *Config) { c.RetryMax = -time.Second },
		"negative lag warn every": func(c *Config) { c.LagWarnEvery = -time.Second },
		"negative db timeout":     func(c *Config) { c.DBTimeout = -time.Second },
		"negative drain timeout":  func(c *Config) { c.DrainTimeout = -time.Second },
		// StopBound would wrap around to a negative bound.
		"huge db timeout":    func(c *Config) { c.DBTimeout = math.MaxInt64 },
		"huge drain timeout": func(c *Config) { c.DrainTimeout = MaxStopTimeout + 1 },
		// 2*HeartbeatInterval used to wrap around: these passed, and the
		// relay never renewed its heartbeat while it went on publishing.
		"max interval, default ttl": func(c *Config) { c.HeartbeatInterval = math.MaxInt64 },
		"max interval, 15s ttl":     func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = math.MaxInt64, 15*time.Second },
		"interval just past half":   func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = math.MaxInt64/2+1, math.MaxInt64 },
		"ttl one below two beats":   func(c *Config) { c.HeartbeatInterval, c.HeartbeatTTL = 5*time.Second, 10*time.Second-1 },
		// BeatCDC would fail with an uncoded database error.
		"NUL in owner":          func(c *Config) { c.Owner = "relay\x00a" },
		"invalid UTF-8 owner":   func(c *Config) { c.Owner = "relay\xffa" },
		"control char in owner": func(c *Config) { c.Owner = "relay\na" },
	}
	why := map[string]string{
		"negative ttl":              "must not be negative",
		"negative retry initial":    "must not be negative",
		"negative retry max":        "must not be negative",
		"negative lag warn every":   "must not be negative",
		"negative db timeout":       "must not be negative",
		"negative drain timeout":    "must not be negative",
		"huge db timeout":           "must be at most 1h0m0s",
		"huge drain timeout":        "must be at most 1h0m0s",
		"max interval, default ttl": "at least twice HeartbeatInterval",
		"max interval, 15s ttl":     "at least twice HeartbeatInterval",
		"interval just past half":   "at least twice HeartbeatInterval",
		"ttl one below two beats":   "at least twice HeartbeatInterval",
		"NUL in owner":              "NUL byte",
		"invalid UTF-8 owner":       "not valid UTF-8",
		"control char in owner":     "control character",
	}
	for name, mutate := range bad {
		t.Run(name, func(t *testing.T) {
			c := ok
			mutate(&c)
			err := c.Validate()
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			if w, found := why[name]; found {
				require.ErrorContains(t, err, w)
			}
			_, err = New(c, nopPublisher{}, nil)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig, "New refuses what Validate refuses")
		})
	}
	_, err = New(ok, nil, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, "a publisher is required")
}

func TestConfigHeartbeatNearOverflow(t *testing.T) {
	ok := Config{ConnString: "postgres://u@127.0.0.1:5432/db", DB: &sql.DB{}}
	for _, c := range []struct{ interval, ttl, wantTTL time.Duration }{
		{math.MaxInt64 / 2, math.MaxInt64, math.MaxInt64},
		{math.MaxInt64 / 2, 0, math.MaxInt64 - 1}, // the default TTL is twice the interval, exactly
		{5 * time.Second, 10 * time.Second, 10 * time.Second},
		{10 * time.Second, 0, 20 * time.Second},
	} {
		cfg := ok
		cfg.HeartbeatInterval, cfg.HeartbeatTTL = c.interval, c.ttl
		require.NoError(t, cfg.Validate(), "interval %d ttl %d", c.interval, c.ttl)
		require.Equal(t, c.wantTTL, cfg.withDefaults().HeartbeatTTL)
	}
	cfg := ok
	cfg.HeartbeatInterval = math.MaxInt64
	require.Equal(t, time.Duration(math.MaxInt64), cfg.withDefaults().HeartbeatTTL, "the default TTL saturates instead of wrapping to 15s")

	require.Equal(t, time.Duration(math.MaxInt64), twice(math.MaxInt64/2+1))
	require.Equal(t, time.Duration(math.MinInt64), twice(math.MinInt64/2-1))
	require.Equal(t, -2*time.Second, twice(-time.Second))
}

func TestStopBoundAddsUpTheStopsTimeouts(t *testing.T) {
	base := Config{ConnString: "postgres://u@127.0.0.1:5432/db", DB: &sql.DB{}}
	for _, c := range []struct {
		name      string
		db, drain time.Duration
		want      time.Duration
	}{
		{"defaults", 0, 0, DefaultDrainTimeout + 4*DefaultDBTimeout},
		{"drain longer than a statement", time.Second, 3 * time.Second, 3*time.Second + 4*time.Second},
		// A status write in progress at the stop takes DBTimeout when it is
		// the longer of the two.
		{"a statement longer than the drain", 2 * time.Second, time.Second, 2*time.Second + 4*2*time.Second},
		{"the largest accepted", MaxStopTimeout, MaxStopTimeout, 5 * MaxStopTimeout},
	} {
		cfg := base
		cfg.DBTimeout, cfg.DrainTimeout = c.db, c.drain
		require.NoError(t, cfg.Validate(), c.name)
		require.Equal(t, c.want, cfg.StopBound(), c.name)
	}
}
