// Package typednil tells a nil interface apart from nothing: a constructor
// handed an interface that holds a nil pointer (or map, func, ...) would
// pass a "== nil" check and panic at its first use.
package typednil

import "reflect"

// Is reports whether v is nil or an interface holding a nil pointer, map,
// slice, func, channel, interface or unsafe pointer.
func Is(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan, reflect.UnsafePointer:
		return rv.IsNil()
	}
	return false
}
