# watermill-outbox: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
GO      ?= go
# An execution count, not a duration: with a duration, go1.26's fuzz
# coordinator can report a spurious "context deadline exceeded" when the time
# runs out while a worker is mid-input (golang/go#75804, fixed in go1.27).
# 30000 inputs take a few seconds per target here.
FUZZTIME ?= 30000x

.PHONY: all db test unit fuzz lint demo bench soak services

all: lint test

## db: make sure a PostgreSQL answers (starts or creates one when needed) and print its URL
db:
	@scripts/ensure-db.sh

## test: the whole suite with the race detector, then every fuzz target for $(FUZZTIME) inputs each
test: unit fuzz

unit:
	@url="$$(scripts/ensure-db.sh)"; \
	echo "tests against $$url"; \
	OUTBOX_TEST_DATABASE_URL="$$url" $(GO) test -race -count=1 -timeout 15m ./...

fuzz:
	@url="$$(scripts/ensure-db.sh)"; \
	for target in $$(grep -rhoE '^func (Fuzz[A-Za-z0-9_]+)' --include='*_test.go' . | awk '{print $$2}' | sort -u); do \
	  pkg="$$(grep -rlE "^func $$target\(" --include='*_test.go' . | head -1 | xargs dirname)"; \
	  echo "fuzz $$target in $$pkg for $(FUZZTIME)"; \
	  OUTBOX_TEST_DATABASE_URL="$$url" $(GO) test -run='^$$' -fuzz="^$$target\$$" -fuzztime=$(FUZZTIME) "$$pkg"; \
	done

## lint: gofmt and go vet must be clean
lint:
	@out="$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))"; \
	if [[ -n "$$out" ]]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

## demo: the main job end to end on local defaults (orders -> outbox -> forwarder -> Pub/Sub -> inbox consumer)
demo:
	@url="$$(scripts/ensure-db.sh)"; \
	OUTBOX_DATABASE_URL="$${OUTBOX_DATABASE_URL:-$$url}" $(GO) run ./examples/orders

## bench: the side-by-side benchmark (writes BENCHMARKS.md data to .bench/)
bench:
	@url="$$(scripts/ensure-db.sh)"; \
	OUTBOX_TEST_DATABASE_URL="$$url" $(GO) run ./cmd/outbox-bench -out .bench/results.json

## soak: the long chaos soak
soak:
	@url="$$(scripts/ensure-db.sh)"; \
	OUTBOX_TEST_DATABASE_URL="$$url" OUTBOX_SOAK=long $(GO) test -race -count=1 -timeout 60m -run TestChaosSoak -v ./internal/chaos/...

## services: start the local brokers the transport tests use, when installed but stopped
services:
	@scripts/ensure-services.sh
