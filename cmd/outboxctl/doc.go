// Command outboxctl operates a watermill-outbox database.
//
//	outboxctl [--database-url URL] [--json] [--timeout D] <command>
//
// The database comes from --database-url or OUTBOX_DATABASE_URL; commands
// that need it refuse clearly (OUTBOXCTL_DATABASE_URL_REQUIRED, exit 2) when
// neither is set. Output is an aligned table by default; --json prints one
// JSON document on stdout and errors as {"error","code","exit_code"} on
// stderr (with "resume" when an interrupted operation can be resumed).
// Progress of long operations goes to stderr, so stdout stays parseable. No
// output ever carries a password (internal/redact masks every error and log
// line); a database URL that does not parse is OUTBOXCTL_INVALID_DATABASE_URL
// (exit 2) with a message that quotes none of it. Every command that opens
// the database, all but migrate, version and debezium config (which only
// prints a connector configuration), refuses a search_path without a
// migrated schema (OUTBOX_SCHEMA_NOT_MIGRATED, exit 2;
// TestEveryCommandNamesUnmigratedSchema). Text from rows is printed with
// control characters escaped.
//
// Commands:
//
//	migrate                     apply the embedded migrations; print the versions applied
//	status                      backlog by status, destination and tenant; oldest pending age;
//	                            ambiguous/failed/exhausted counts and top failure codes;
//	                            stuck correlations; live relays and their MaxAttempts (warns when
//	                            they differ); relay mode (package status)
//	inspect <message-id>        every column of one row, headers, lease, failure, and a bounded
//	                            payload preview (--payload-bytes); --payload-to FILE|- for the raw bytes
//	redrive | purge             parked rows (EXHAUSTED/FAILED) matching --status, --destination,
//	                            --tenant, --failure-code, --message-id, --since/--until (RFC 3339),
//	                            through the admin journal: --dry-run prints plan, count and digest;
//	                            --approve records the approval of that digest under --ticket
//	                            (approver: the database login; binds the rows matching now);
//	                            executing requires --ticket, the approved --expect-digest and that
//	                            recorded approval; --force-takeover takes a live operation (recorded);
//	                            not bounded by --timeout; a cut run prints the command that
//	                            resumes it; progress per batch on stderr (package journal)
//	cleanup                     one retention run (package retention): --horizon, --batch-size,
//	                            --max-batches, --archive, --inbox-horizon, --by-created-at (CDC only);
//	                            horizons below 72h / 7 days need --allow-short-horizons
//	relay --to <sink>           a standalone forwarder until SIGINT/SIGTERM (drains the pass);
//	                            --metrics-addr serves /metrics (forwarder metrics + backlog gauges),
//	                            /healthz and /readyz; every flag also from OUTBOX_<FLAG> (flags win);
//	                            --log-format json|text, --log-level; examples in deploy/;
//	                            each sink classifies publish errors with its transport's Classify:
//	                              log     one JSON line per message on stdout
//	                              pubsub  --pubsub-project (PUBSUB_EMULATOR_HOST honoured),
//	                                      --pubsub-create-topics, --pubsub-ordering
//	                              kafka   --kafka-brokers host:port,... (comma separated),
//	                                      --kafka-auto-create-topics
//	                              amqp    --amqp-url (default amqp://guest:guest@127.0.0.1:5672/),
//	                                      --amqp-create-exchanges
//	                              nats    --nats-url (default nats://127.0.0.1:4222; JetStream),
//	                                      --nats-create-streams
//	                            a missing topic/exchange parks rows FAILED unless the sink's
//	                            create flag is set; a NATS subject no stream captures is
//	                            unavailable: rows stay PENDING (no attempt spent) and the
//	                            destination's breaker opens until a stream answers (unless
//	                            --nats-create-streams); an empty, malformed or refused sink
//	                            setting is OUTBOX_INVALID_CONFIG (exit 2), before any dial.
//	                            Only downstreams whose transport packages exist are offered
//	                            (see `relay --help`).
//	debezium config             the generated connector configuration (--format json|properties,
//	                            --topic-prefix, -o file); needs no database
//	debezium enable|disable     switch the relay mode (enable refused while polling relays are live)
//	debezium status             relay mode and live polling relays
//	console                     the operator web console on 127.0.0.1:8089 (--listen, --tls-cert/--tls-key,
//	                            --read-only): people sign in with their PostgreSQL login; overview,
//	                            parked rows, row inspector, relays, the journal; plan, approve (another
//	                            login) and execute redrives and purges (docs/CONSOLE.md)
//	version                     module version, VCS revision, Go version (build information)
//
// # Exit codes
//
//	0  ok
//	1  the operation failed (a database error, STATUS_MESSAGE_NOT_FOUND,
//	   OUTBOXCTL_OPERATION_INTERRUPTED, ...)
//	2  usage error: unknown command or flag, bad argument count or value, a configuration the
//	   package refuses (OUTBOX_INVALID_CONFIG), JOURNAL_INVALID_FILTER, JOURNAL_TICKET_REQUIRED,
//	   OUTBOXCTL_DIGEST_REQUIRED, OUTBOXCTL_DATABASE_URL_REQUIRED, OUTBOXCTL_INVALID_DATABASE_URL,
//	   OUTBOXCTL_DATABASE_REFUSED (the server refused the URL's database, role, password or a
//	   parameter value), OUTBOX_SCHEMA_NOT_MIGRATED, RETENTION_HORIZON_BELOW_FLOOR
//	3  refused by a guard: JOURNAL_ALREADY_EXECUTED, JOURNAL_IN_FLIGHT, JOURNAL_LEASE_LOST,
//	   JOURNAL_PLAN_MISMATCH, OUTBOXCTL_DIGEST_MISMATCH, RELAY_MODE_CONFLICT,
//	   OUTBOXCTL_RETENTION_MODE_MISMATCH, JOURNAL_NOT_APPROVED, JOURNAL_APPROVAL_EXCEEDED,
//	   JOURNAL_ALREADY_APPROVED
//	4  OUTBOXCTL_DATABASE_UNREACHABLE: the first ping got no answer from a server (refused,
//	   timed out, reset); safe to retry
//	5  OUTBOXCTL_CLEANUP_SKIPPED: another session holds the retention lock; the error names it
//
// Every typed refusal prints its stable code on a line of its own
// ("code: RELAY_MODE_CONFLICT").
package main
