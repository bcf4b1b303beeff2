//go:build !kfake

package main

import "errors"

// inProcessKafka is unavailable in this build: the kfake version go.mod pins
// does not compile against the franz-go version go.mod selects (v1.21.7;
// kfake needs v1.22.3 with kmsg v1.15.1). See the README for the one-line
// module-file override, or point KAFKA_BROKERS at a real cluster.
func inProcessKafka(string, int32) ([]string, func(), error) {
	return nil, nil, errors.New("no KAFKA_BROKERS and this binary was built without the in-process Kafka: " +
		"build it with -tags kfake and a module file requiring github.com/twmb/franz-go v1.22.3 " +
		"(the commands are in examples/kafka/README.md), or set KAFKA_BROKERS")
}
