#!/usr/bin/env bash
# The whole test suite: unit tests, doctests, and the integration tests
# against real services on 127.0.0.1: PostgreSQL, MariaDB, SQLite, Redis,
# RabbitMQ, a Kafka-compatible broker (tansu, installed once by
# scripts/kafka.sh), an SQS endpoint (moto, installed once by
# scripts/sqs.sh) and RocketMQ (name server and broker, installed once by
# scripts/rocketmq.sh). Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/services.sh
scripts/kafka.sh
scripts/sqs.sh
scripts/rocketmq.sh
cargo test --workspace --all-features "$@"
