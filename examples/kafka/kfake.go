package main

import "github.com/twmb/franz-go/pkg/kfake"

// inProcessKafka starts franz-go's in-process Kafka with one topic.
func inProcessKafka(topic string, partitions int32) ([]string, func(), error) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topic))
	if err != nil {
		return nil, nil, err
	}
	return c.ListenAddrs(), c.Close, nil
}
