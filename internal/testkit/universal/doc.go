// Package universal runs watermill's universal Pub/Sub test suite
// (github.com/ThreeDotsLabs/watermill/pubsub/tests.TestPubSub) against the
// composite the product actually offers: the transactional publisher (each
// Publish in its own committed transaction), the fenced forwarder, and a
// downstream broker (a persistent watermill GoChannel standing in for a
// broker with durable topics). See universal_test.go for the Features flags
// and why each is set the way it is.
package universal
