package envelope

import (
	"bytes"
	"encoding/json"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
)

// EncodeHeaders turns application metadata into the jsonb text stored in the
// headers column. It uses encoding/json, so backslashes, quotes, control
// characters and non-ASCII text are escaped correctly (the Java ancestor's
// hand-written codec broke on a trailing backslash). It refuses what
// PostgreSQL cannot store or what would not come back unchanged: a NUL
// character (jsonb rejects \u0000) and invalid UTF-8 (encoding/json would
// silently replace it with U+FFFD). Keys must be non-empty.
func EncodeHeaders(h map[string]string) ([]byte, error) {
	if err := validateHeaders(h); err != nil {
		return nil, err
	}
	if len(h) == 0 {
		return []byte("{}"), nil
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(h); err != nil {
		return nil, outbox.Wrap(outbox.CodeInvalidHeader, "envelope", err, "encode headers")
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}

// validateHeaders is EncodeHeaders' refusals without the encoding: ToRow
// checks headers once here, and the publisher encodes them once.
func validateHeaders(h map[string]string) error {
	for k, v := range h {
		if err := checkText("header name", k); err != nil {
			return err
		}
		if k == "" {
			return outbox.Errorf(outbox.CodeInvalidHeader, "envelope", "header name must not be empty")
		}
		if err := checkText("header "+k, v); err != nil {
			return err
		}
	}
	return nil
}

// DecodeHeaders parses the headers column. Empty input (nil or "": no
// column text) is no headers, an empty map. Anything else but a JSON object
// whose values are all strings, whitespace-only input included, is a
// corrupt row (OUTBOX_CORRUPT_ROW).
func DecodeHeaders(raw []byte) (map[string]string, error) {
	if string(raw) == "{}" {
		return map[string]string{}, nil
	}
	// The common case in one step. encoding/json would read a null value
	// as "" here, so text holding null anywhere goes the slow way below,
	// as does anything this step refuses (not an object, a value that is
	// not a string); that way names what is wrong.
	if !bytes.Contains(raw, []byte("null")) {
		var flat map[string]string
		if json.Unmarshal(raw, &flat) == nil && flat != nil {
			return flat, nil
		}
	}
	return decodeHeadersGeneric(raw)
}

// decodeHeadersGeneric is DecodeHeaders without the fast path: it decodes
// any JSON and then checks its shape, so it can say what is wrong.
func decodeHeadersGeneric(raw []byte) (map[string]string, error) {
	if len(raw) == 0 {
		return map[string]string{}, nil
	}
	var generic any
	if err := json.Unmarshal(raw, &generic); err != nil {
		return nil, outbox.Wrap(outbox.CodeCorruptRow, "envelope", err, "headers are not valid JSON")
	}
	obj, ok := generic.(map[string]any)
	if !ok {
		return nil, outbox.Errorf(outbox.CodeCorruptRow, "envelope", "headers must be a JSON object, got %s", jsonKind(generic))
	}
	out := make(map[string]string, len(obj))
	for k, v := range obj {
		s, ok := v.(string)
		if !ok {
			return nil, outbox.Errorf(outbox.CodeCorruptRow, "envelope", "header %q must be a string, got %s", k, jsonKind(v))
		}
		out[k] = s
	}
	return out, nil
}

// checkText refuses values PostgreSQL text (and jsonb) cannot hold.
func checkText(what, s string) error {
	if why := pgtext.Unstorable(s); why != "" {
		return outbox.Errorf(outbox.CodeInvalidHeader, "envelope", "%s %s", what, why)
	}
	return nil
}

func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case float64:
		return "a number"
	case string:
		return "a string"
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	}
	return "an unknown value"
}
