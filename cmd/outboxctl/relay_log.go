package main

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// logPublisher is the `--to log` downstream: one JSON line per message on
// stdout, confirmed as soon as the line is written.
//
// A write to a stdout nobody reads blocks for ever (a pipe is not pollable,
// so it has no deadline). The forwarder leaves such a publish behind after
// PublishTimeout and records it AMBIGUOUS; the publishes queued behind it
// give up when their message's context ends instead of waiting for it, and
// Close waits for it only sinkCloseTimeout.
type logPublisher struct {
	turn   chan struct{} // one write at a time: lines must not interleave
	out    io.Writer
	closed atomic.Bool
}

func newLogPublisher(out io.Writer) *logPublisher {
	return &logPublisher{out: out, turn: make(chan struct{}, 1)}
}

type logLine struct {
	Topic         string            `json:"topic"`
	UUID          string            `json:"uuid"`
	Metadata      map[string]string `json:"metadata"`
	PayloadBase64 string            `json:"payload_base64"`
	PayloadText   *string           `json:"payload_text,omitempty"`
}

var errLogPublisherClosed = errors.New("log publisher closed")

func (p *logPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.closed.Load() {
		return errLogPublisherClosed
	}
	var done <-chan struct{} // the first message's context: the forwarder's publish timeout
	if len(msgs) > 0 {
		done = msgs[0].Context().Done()
	}
	select {
	case p.turn <- struct{}{}:
	case <-done:
		return fmt.Errorf("stdout is busy with an earlier line (is it read?): %w", msgs[0].Context().Err())
	}
	defer func() { <-p.turn }()
	if p.closed.Load() {
		return errLogPublisherClosed
	}
	for _, m := range msgs {
		l := logLine{Topic: topic, UUID: m.UUID, Metadata: map[string]string(m.Metadata), PayloadBase64: base64.StdEncoding.EncodeToString(m.Payload)}
		if l.Metadata == nil {
			l.Metadata = map[string]string{}
		}
		if utf8.Valid(m.Payload) {
			s := string(m.Payload)
			l.PayloadText = &s
		}
		b, err := json.Marshal(l)
		if err != nil {
			return err
		}
		if _, err := p.out.Write(append(b, '\n')); err != nil {
			return err
		}
	}
	return nil
}

// Close refuses further publishes and waits up to sinkCloseTimeout for a
// line being written; a write blocked longer (stdout not read) is left
// behind and reported.
func (p *logPublisher) Close() error {
	p.closed.Store(true)
	t := time.NewTimer(sinkCloseTimeout)
	defer t.Stop()
	select {
	case p.turn <- struct{}{}:
		<-p.turn
		return nil
	case <-t.C:
		return errors.New("a line to stdout was still being written (stdout is not read); its message was recorded AMBIGUOUS and is published again")
	}
}
