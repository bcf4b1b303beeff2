package inbox_test

import "github.com/fencedoutbox/watermill-outbox/publisher"

func publisherWithNUL() publisher.Config { return publisher.Config{Producer: "a\x00b"} }
