#!/usr/bin/env bash
# The whole test suite: unit tests, doctests, and the integration tests
# against real services on 127.0.0.1: PostgreSQL, MariaDB, SQLite, Redis,
# RabbitMQ, a Kafka-compatible broker (tansu, installed once by
# scripts/kafka.sh), an SQS endpoint (moto, installed once by
# scripts/sqs.sh) and RocketMQ (name server and broker, installed once by
# scripts/rocketmq.sh); then the short chaos matrix (scripts/chaos.sh).
# Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/services.sh
scripts/kafka.sh
scripts/sqs.sh
scripts/rocketmq.sh
cargo test --workspace --all-features "$@"
# The short chaos matrix (every source and every store, ~2,000 orders and
# >= 20 SIGKILLs per cell, four cells with a database or broker restart),
# with the binary the tests just built (all features: fail points included).
# Skipped when arguments narrow the run to some tests.
if [ $# -eq 0 ]; then
  CHAOS_BIN="${CARGO_TARGET_DIR:-target}/debug/idemq" scripts/chaos.sh
fi
