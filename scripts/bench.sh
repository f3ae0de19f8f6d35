#!/usr/bin/env bash
# The benchmark suite: builds idemq-bench in release, makes sure the services
# answer on 127.0.0.1 (PostgreSQL, MariaDB, Redis, RabbitMQ, NATS, Mosquitto;
# the Kafka-compatible broker, moto (SQS) and RocketMQ only if they are
# already installed — otherwise their rows are skipped), and
# prints one Markdown table on stdout (progress goes to stderr).
#
#   scripts/bench.sh                 # default run, about 2–4 minutes
#   scripts/bench.sh --full          # claim cost with 1 M and 10 M keys stored
#   scripts/bench.sh --only redis    # one section; --help lists every knob
#
# Not part of the test suite or CI: numbers depend on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/services.sh >&2
if command -v tansu >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/tansu" ]; then
  scripts/kafka.sh >&2 || echo "bench: the Kafka broker did not start; its row is skipped" >&2
fi
if [ -x "$HOME/.idemq-tools/moto/bin/moto_server" ] || command -v moto_server >/dev/null 2>&1; then
  scripts/sqs.sh >&2 || echo "bench: the SQS endpoint did not start; its row is skipped" >&2
fi
if [ -x "$HOME/.cargo/bin/rocketmq-broker-rust" ]; then
  scripts/rocketmq.sh >&2 || echo "bench: RocketMQ did not start; its row is skipped" >&2
fi
cargo build --release -p idemq-bench >&2
exec target/release/idemq-bench "$@"
