package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"

	"github.com/ThreeDotsLabs/watermill"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// logFlags are the relay's --log-format and --log-level.
type logFlags struct {
	format string
	level  string
}

// newLogger returns the relay's logger: log/slog with a JSON or text handler
// on w, at the given level, behind a handler that redacts every message and
// attribute (see redactHandler). Both handlers escape control characters in
// values, so a topic or a failure detail cannot forge a log line or drive a
// terminal.
func (a *app) newLogger(w io.Writer, lf logFlags) (*slog.Logger, error) {
	var level slog.Level
	switch strings.ToLower(strings.TrimSpace(lf.level)) {
	case "debug":
		level = slog.LevelDebug
	case "", "info":
		level = slog.LevelInfo
	case "warn", "warning":
		level = slog.LevelWarn
	case "error":
		level = slog.LevelError
	default:
		return nil, outbox.Errorf(CodeUsage, "outboxctl relay", "--log-level is %q; use debug, info, warn or error", lf.level)
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	switch strings.ToLower(strings.TrimSpace(lf.format)) {
	case "", "text":
		h = slog.NewTextHandler(w, opts)
	case "json":
		h = slog.NewJSONHandler(w, opts)
	default:
		return nil, outbox.Errorf(CodeUsage, "outboxctl relay", "--log-format is %q; use text or json", lf.format)
	}
	return slog.New(&redactHandler{inner: h, redact: a.redactString}), nil
}

// watermillLogger adapts l for the forwarder and the transports. Fields are
// written sorted by name (watermill passes a map), so the same event logs
// the same line. Watermill's Trace level is written below Debug, so
// --log-level debug does not include it.
func watermillLogger(l *slog.Logger) watermill.LoggerAdapter { return slogAdapter{l: l} }

const levelTrace = slog.LevelDebug - 4

type slogAdapter struct{ l *slog.Logger }

func sortedAttrs(fields watermill.LogFields, extra ...any) []any {
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]any, 0, 2*len(keys)+len(extra))
	for _, k := range keys {
		out = append(out, slog.Any(k, fields[k]))
	}
	return append(out, extra...)
}

func (a slogAdapter) Error(msg string, err error, fields watermill.LogFields) {
	a.l.Error(msg, sortedAttrs(fields, slog.Any("error", err))...)
}
func (a slogAdapter) Info(msg string, fields watermill.LogFields) {
	a.l.Info(msg, sortedAttrs(fields)...)
}
func (a slogAdapter) Debug(msg string, fields watermill.LogFields) {
	a.l.Debug(msg, sortedAttrs(fields)...)
}
func (a slogAdapter) Trace(msg string, fields watermill.LogFields) {
	a.l.Log(context.Background(), levelTrace, msg, sortedAttrs(fields)...)
}
func (a slogAdapter) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return slogAdapter{l: a.l.With(sortedAttrs(fields)...)}
}

// redactHandler masks secrets in a record's message and in every string,
// error or Stringer attribute before the inner handler formats it.
type redactHandler struct {
	inner  slog.Handler
	redact func(string) string
}

func (h *redactHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.inner.Enabled(ctx, l)
}

func (h *redactHandler) Handle(ctx context.Context, r slog.Record) error {
	out := slog.NewRecord(r.Time, r.Level, h.redact(r.Message), r.PC)
	r.Attrs(func(at slog.Attr) bool {
		out.AddAttrs(h.attr(at))
		return true
	})
	return h.inner.Handle(ctx, out)
}

func (h *redactHandler) attr(at slog.Attr) slog.Attr {
	v := at.Value.Resolve()
	switch v.Kind() {
	case slog.KindString:
		return slog.String(at.Key, h.redact(v.String()))
	case slog.KindGroup:
		attrs := v.Group()
		red := make([]any, len(attrs))
		for i, g := range attrs {
			red[i] = h.attr(g)
		}
		return slog.Group(at.Key, red...)
	case slog.KindAny:
		switch x := v.Any().(type) {
		case nil:
			return at
		case error:
			return slog.String(at.Key, h.redact(x.Error()))
		case fmt.Stringer:
			return slog.String(at.Key, h.redact(x.String()))
		case []byte:
			return slog.String(at.Key, h.redact(string(x)))
		default:
			return slog.String(at.Key, h.redact(fmt.Sprint(x)))
		}
	}
	return at
}

func (h *redactHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	red := make([]slog.Attr, len(attrs))
	for i, at := range attrs {
		red[i] = h.attr(at)
	}
	return &redactHandler{inner: h.inner.WithAttrs(red), redact: h.redact}
}

func (h *redactHandler) WithGroup(name string) slog.Handler {
	return &redactHandler{inner: h.inner.WithGroup(name), redact: h.redact}
}
