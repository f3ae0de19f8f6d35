#!/usr/bin/env bash
# The benchmark suite: builds idemq-bench in release, installs and starts the
# services on 127.0.0.1 (as scripts/test.sh does: PostgreSQL, MariaDB, Redis,
# RabbitMQ, NATS, Mosquitto, Apache Kafka, Apache RocketMQ, moto for SQS; a
# broker that does not start has its rows skipped), and prints one Markdown
# table on stdout (progress goes to stderr). The peer rows' Python side
# (AWS Lambda Powertools) is installed into target/bench-venv once.
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
scripts/kafka.sh >&2 || echo "bench: Apache Kafka did not start; its rows are skipped" >&2
scripts/sqs.sh >&2 || echo "bench: the SQS endpoint did not start; its row is skipped" >&2
scripts/rocketmq.sh >&2 || echo "bench: Apache RocketMQ did not start; its row is skipped" >&2
# The peer rows' AWS Lambda Powertools (Python, from PyPI), once, pinned in
# crates/idemq-bench/peers/requirements.txt; without it those rows are skipped.
venv=target/bench-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import aws_lambda_powertools, redis' 2>/dev/null; then
  { python3 -m venv "$venv" \
      && "$venv/bin/pip" install --quiet -r crates/idemq-bench/peers/requirements.txt; } >&2 \
    || echo "bench: Powertools could not be installed into $venv; its rows are skipped" >&2
fi
cargo build --release -p idemq-bench -p idemq-cli >&2
exec target/release/idemq-bench "$@"
