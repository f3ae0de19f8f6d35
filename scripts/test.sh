#!/usr/bin/env bash
# The whole test suite: unit tests, doctests, and the integration tests
# against real services on 127.0.0.1, each installed once and started here
# (nothing needs to run beforehand): PostgreSQL, MariaDB, Redis, RabbitMQ,
# Mosquitto and NATS from Debian's packages (scripts/services.sh), Apache
# Kafka and Apache RocketMQ from Maven Central (scripts/kafka.sh,
# scripts/rocketmq.sh), SQS on moto from PyPI (scripts/sqs.sh), Debian's
# chromium for the console's browser test (scripts/chromium.sh), a Redis
# Cluster of six redis-server nodes (scripts/redis-cluster.sh), FerretDB
# (MongoDB wire protocol over PostgreSQL) from the Go module proxy
# (scripts/ferretdb.sh); then the short chaos matrix (scripts/chaos.sh).
# Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
last=$SECONDS
took() {
  echo "test.sh: $1: $((SECONDS - last)) s (total $((SECONDS - started)) s)"
  last=$SECONDS
}
scripts/deps.sh
took deps
scripts/services.sh
took "services (Debian)"
scripts/redis-cluster.sh
took "Redis Cluster (3 masters, 3 replicas)"
scripts/kafka.sh
took "Apache Kafka"
scripts/sqs.sh
took "SQS (moto)"
scripts/rocketmq.sh
took "Apache RocketMQ"
scripts/chromium.sh
took "chromium (the console's browser test)"
scripts/ferretdb.sh
took "FerretDB (the Mongo store's tests)"
cargo test --workspace --all-features "$@"
took "cargo test (build and run)"
# The short chaos matrix (every source and every store, ~2,000 orders and
# >= 20 SIGKILLs per cell, four cells with a database or broker restart),
# with the binary the tests just built (all features: fail points included).
# Skipped when arguments narrow the run to some tests.
if [ $# -eq 0 ]; then
  CHAOS_BIN="${CARGO_TARGET_DIR:-target}/debug/idemq" scripts/chaos.sh
  took "short chaos matrix"
fi
