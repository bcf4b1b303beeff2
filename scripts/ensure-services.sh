#!/usr/bin/env bash
# Start RabbitMQ and NATS (JetStream) when they are installed but not running.
# Transport tests skip with a message when a broker still does not answer.
set -uo pipefail
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_for() { for _ in $(seq 1 60); do answers "$1" && return 0; sleep 0.5; done; return 1; }

if ! answers 5672 && command -v rabbitmq-server >/dev/null 2>&1; then
  echo "ensure-services: starting RabbitMQ" >&2
  rabbitmq-server -detached >&2 || true
  wait_for 5672 || echo "ensure-services: RabbitMQ did not come up on 5672" >&2
fi
if ! answers 4222 && [[ -x /usr/sbin/nats-server ]]; then
  echo "ensure-services: starting NATS with JetStream" >&2
  mkdir -p /var/lib/nats-server
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log >&2 || true
  wait_for 4222 || echo "ensure-services: NATS did not come up on 4222" >&2
fi
exit 0
