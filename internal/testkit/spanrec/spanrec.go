// Package spanrec is a recording OpenTelemetry TracerProvider for the core's
// tests. The core module must not require the OTel SDK (a service importing
// the publisher would inherit it), so the tests that check spans record them
// here instead of with sdk/trace/tracetest: every span gets a fresh span id,
// the trace id of its parent (or a fresh one), and keeps its name, kind,
// attributes, parent, links and status for inspection once ended.
//
// It implements only what the tests read; it is not a tracing SDK (no
// sampling, no processors, no export). The end-to-end trace test, in a
// non-core module, uses the real SDK.
package spanrec

import (
	"context"
	"crypto/rand"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Recorder is a trace.TracerProvider that records every span it starts.
type Recorder struct {
	noop.TracerProvider
	mu    sync.Mutex
	ended []*Span
}

// New returns an empty Recorder.
func New() *Recorder { return &Recorder{} }

// Tracer returns a tracer whose spans the Recorder records.
func (r *Recorder) Tracer(string, ...trace.TracerOption) trace.Tracer {
	return &tracer{r: r}
}

// Ended returns the spans ended so far, in the order they ended.
func (r *Recorder) Ended() []*Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*Span(nil), r.ended...)
}

type tracer struct {
	noop.Tracer
	r *Recorder
}

func (t *tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	cfg := trace.NewSpanStartConfig(opts...)
	parent := trace.SpanContextFromContext(ctx)
	if cfg.NewRoot() {
		parent = trace.SpanContext{}
	}
	scc := trace.SpanContextConfig{TraceFlags: trace.FlagsSampled}
	if parent.IsValid() {
		scc.TraceID = parent.TraceID()
		scc.TraceState = parent.TraceState()
	} else {
		_, _ = rand.Read(scc.TraceID[:])
	}
	_, _ = rand.Read(scc.SpanID[:])
	s := &Span{
		r:      t.r,
		name:   name,
		kind:   cfg.SpanKind(),
		parent: parent,
		sc:     trace.NewSpanContext(scc),
		attrs:  append([]attribute.KeyValue(nil), cfg.Attributes()...),
		links:  cfg.Links(),
	}
	return trace.ContextWithSpan(ctx, s), s
}

// Span is one recorded span. Its accessors mirror the SDK's ReadOnlySpan.
type Span struct {
	noop.Span
	r *Recorder

	mu        sync.Mutex
	name      string
	kind      trace.SpanKind
	parent    trace.SpanContext
	sc        trace.SpanContext
	attrs     []attribute.KeyValue
	links     []trace.Link
	status    codes.Code
	statusMsg string
	errs      []error
	ended     bool
}

// SpanContext is the span's own context.
func (s *Span) SpanContext() trace.SpanContext { return s.sc }

// IsRecording is true until End.
func (s *Span) IsRecording() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.ended
}

// SetAttributes records kv.
func (s *Span) SetAttributes(kv ...attribute.KeyValue) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.attrs = append(s.attrs, kv...)
}

// SetStatus records the status.
func (s *Span) SetStatus(c codes.Code, msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.status, s.statusMsg = c, msg
}

// RecordError records err.
func (s *Span) RecordError(err error, _ ...trace.EventOption) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs = append(s.errs, err)
}

// SetName renames the span.
func (s *Span) SetName(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.name = name
}

// End records the span as ended (once).
func (s *Span) End(...trace.SpanEndOption) {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended = true
	s.mu.Unlock()
	s.r.mu.Lock()
	s.r.ended = append(s.r.ended, s)
	s.r.mu.Unlock()
}

// TracerProvider returns the Recorder.
func (s *Span) TracerProvider() trace.TracerProvider { return s.r }

// Name is the span's name.
func (s *Span) Name() string { s.mu.Lock(); defer s.mu.Unlock(); return s.name }

// SpanKind is the span's kind.
func (s *Span) SpanKind() trace.SpanKind { return s.kind }

// Parent is the parent's span context (invalid for a root span).
func (s *Span) Parent() trace.SpanContext { return s.parent }

// Links are the links given at start.
func (s *Span) Links() []trace.Link { return s.links }

// Attributes are the attributes given at start and set since.
func (s *Span) Attributes() []attribute.KeyValue {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]attribute.KeyValue(nil), s.attrs...)
}

// Attr returns the last value set for key, and whether one was.
func (s *Span) Attr(key attribute.Key) (attribute.Value, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.attrs) - 1; i >= 0; i-- {
		if s.attrs[i].Key == key {
			return s.attrs[i].Value, true
		}
	}
	return attribute.Value{}, false
}

// Status is the span's status code and description.
func (s *Span) Status() (codes.Code, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status, s.statusMsg
}

// Errors are the errors recorded on the span.
func (s *Span) Errors() []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]error(nil), s.errs...)
}
