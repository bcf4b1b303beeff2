package redact_test

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/fencedoutbox/watermill-outbox/internal/redact"
)

func TestStringMasksEveryForm(t *testing.T) {
	for _, in := range []string{
		"postgres://postgres:S3cretPW%Z@127.0.0.1:5432/test",
		"postgres://postgres:S3cretPW@[::1/test",
		"postgres://u:S3cretPW@h/db?sslmode=disable",
		"amqp://guest:S3cretPW@localhost:5672/",
		"nats://u:S3cretPW@localhost:4222",
		"postgres://u:S3c@retPW@h/db",
		"host=h user=u password=S3cretPW dbname=d",
		"host=h password='S3cret PW' dbname=d",
		"postgres://h/db?password=S3cretPW&sslmode=disable",
		`parse "postgres://postgres:S3cretPW%Z@127.0.0.1/test": invalid URL escape "%Z"`,
	} {
		out := redact.String(in)
		if strings.Contains(out, "S3cret") || strings.Contains(out, "retPW") {
			t.Errorf("String(%q) = %q: still carries the secret", in, out)
		}
		if !strings.Contains(out, redact.Mask) {
			t.Errorf("String(%q) = %q: no mask", in, out)
		}
	}
	if got := redact.String("postgres://u@h/db"); got != "postgres://u@h/db" {
		t.Errorf("a URL without a password changed: %q", got)
	}
}

func TestErrorMasksQuotedSecretsAndKeepsTheChain(t *testing.T) {
	dsn := "postgres://postgres:S3cretPW%Z@127.0.0.1:5432/test"
	_, perr := url.Parse(dsn)
	if perr == nil {
		t.Fatal("url.Parse accepted a malformed escape")
	}
	sentinel := errors.New("boom")
	err := redact.Error(fmt.Errorf("%w: %w", sentinel, perr), dsn)
	if strings.Contains(err.Error(), "S3cret") {
		t.Fatalf("error still carries the secret: %q", err)
	}
	if !errors.Is(err, sentinel) {
		t.Fatal("errors.Is lost the chain")
	}
	if redact.Error(nil, dsn) != nil {
		t.Fatal("nil error must stay nil")
	}
}
