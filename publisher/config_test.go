package publisher_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

func TestConfigValidation(t *testing.T) {
	require.NoError(t, publisher.Config{}.Validate(), "the zero value is valid")
	require.NoError(t, publisher.Config{Notify: true}.Validate(), "defaults satisfy their own rules")
	require.LessOrEqual(t, len(publisher.DefaultNotifyChannel), 63)
	bad := []publisher.Config{
		{Producer: "a\x00b"},
		{Producer: "\xff"},
		{Producer: "svc\nforged"},
		{Producer: "svc\x1b[31m"},
		{Notify: true, NotifyChannel: strings.Repeat("c", 64)},
		{NotifyChannel: "ch\x00"},
	}
	s := newSchema(t)
	for _, cfg := range bad {
		require.ErrorIs(t, cfg.Validate(), outbox.ErrInvalidConfig, "%+v", cfg)
		tx := begin(t, s.DB, nil)
		_, err := publisher.New(tx, cfg, nil)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		err = publisher.InTx(context.Background(), s.DB, cfg, func(context.Context, *sql.Tx, *publisher.Publisher) error {
			t.Fatal("fn must not run with an invalid config")
			return nil
		})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	}
	require.ErrorIs(t, publisher.InTx(context.Background(), nil, publisher.Config{}, func(context.Context, *sql.Tx, *publisher.Publisher) error { return nil }), outbox.ErrInvalidConfig)
	require.ErrorIs(t, publisher.InTx(context.Background(), s.DB, publisher.Config{}, nil), outbox.ErrInvalidConfig)
}
