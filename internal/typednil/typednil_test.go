package typednil_test

import (
	"io"
	"testing"
	"unsafe"

	"github.com/fencedoutbox/watermill-outbox/internal/typednil"
)

type closer struct{}

func (*closer) Close() error { return nil }

type funcCloser func()

func (funcCloser) Close() error { return nil }

func TestIs(t *testing.T) {
	var nilPtr *closer
	var nilFunc funcCloser
	var nilMap map[string]int
	var nilSlice []int
	var nilChan chan int
	var nilUnsafe unsafe.Pointer
	cases := []struct {
		name string
		v    any
		want bool
	}{
		{"untyped nil", nil, true},
		{"nil interface value", io.Closer(nil), true},
		{"interface holding a nil pointer", io.Closer(nilPtr), true},
		{"interface holding a nil func", io.Closer(nilFunc), true},
		{"nil map", nilMap, true},
		{"nil slice", nilSlice, true},
		{"nil channel", nilChan, true},
		{"nil unsafe pointer", nilUnsafe, true},
		{"a pointer", &closer{}, false},
		{"interface holding a pointer", io.Closer(&closer{}), false},
		{"a func", funcCloser(func() {}), false},
		{"a struct value", struct{}{}, false},
		{"zero int", 0, false},
		{"empty string", "", false},
	}
	for _, c := range cases {
		if got := typednil.Is(c.v); got != c.want {
			t.Errorf("%s: Is = %t, want %t", c.name, got, c.want)
		}
	}
}
