package debezium

import "bytes"

// ShippedOptions are the options the shipped configuration files are
// generated with: the defaults, so topics equal destinations as with the
// polling relay.
var ShippedOptions = Options{}

// ShippedFiles returns the contents of the files shipped under debezium/,
// by file name. `go run ./debezium/internal/gen` writes them; a test fails
// when the files on disk differ, so the shipped configuration cannot drift
// from the code.
func ShippedFiles() (map[string][]byte, error) {
	c := Generate(ShippedOptions)
	var j, p bytes.Buffer
	if err := c.WriteJSON(&j); err != nil {
		return nil, err
	}
	if err := c.WriteProperties(&p); err != nil {
		return nil, err
	}
	return map[string][]byte{
		"outbox-connector.json":       j.Bytes(),
		"outbox-connector.properties": p.Bytes(),
	}, nil
}
