#!/usr/bin/env bash
# The whole test suite: unit tests, doctests, and the integration tests
# against real services on 127.0.0.1, each installed once and started here
# (nothing needs to run beforehand; scripts/start-services.sh): PostgreSQL,
# MariaDB, Redis, RabbitMQ, Mosquitto and NATS from Debian's packages
# (scripts/services.sh), Apache Kafka and Apache RocketMQ from Maven Central
# (scripts/kafka.sh, scripts/rocketmq.sh), SQS on moto from PyPI
# (scripts/sqs.sh), Debian's chromium for the console's browser test
# (scripts/chromium.sh), a Redis Cluster of six redis-server nodes
# (scripts/redis-cluster.sh), FerretDB (MongoDB wire protocol over
# PostgreSQL) from the Go module proxy (scripts/ferretdb.sh); then the short
# chaos matrix (scripts/chaos.sh).
#
# The services start while the test binaries build. The tests run under
# cargo-nextest (scripts/deps.sh installs it once; .config/nextest.toml
# says how many at once and which ones must not overlap), each in a process
# of its own; the doctests under `cargo test --doc`, beside the chaos matrix.
#
#   scripts/test.sh                  everything
#   scripts/test.sh -E 'test(/^kafka::/)'   some tests (nextest's filters);
#                                    doctests and chaos are then skipped
# Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
last=$SECONDS
took() {
  echo "test.sh: $1: $((SECONDS - last)) s (total $((SECONDS - started)) s)"
  last=$SECONDS
}
scripts/deps.sh --nextest
took deps
services_log="$(mktemp /tmp/idemq-start-services.XXXXXX)"
scripts/start-services.sh >"$services_log" 2>&1 &
services=$!
cargo test --workspace --all-features --no-run
took "build the tests (services starting beside)"
if ! wait "$services"; then
  cat "$services_log"
  exit 1
fi
cat "$services_log"
rm -f "$services_log"
took "services (the rest of their start)"
cargo nextest run --workspace --all-features --profile ci "$@"
took "run the tests"
if [ $# -eq 0 ]; then
  # The doctests compile while the short chaos matrix runs (every source and
  # every store, ~2,000 orders and >= 20 SIGKILLs per cell, five cells with
  # a database or broker restart, with the binary the tests just built: all
  # features, fail points included): the cells wait on brokers much of the
  # time, and rustdoc fills it. The doctests' output is printed after the
  # matrix.
  doc_log="$(mktemp /tmp/idemq-doctests.XXXXXX)"
  cargo test --workspace --all-features --doc >"$doc_log" 2>&1 &
  doctests=$!
  chaos=0
  CHAOS_BIN="${CARGO_TARGET_DIR:-target}/debug/idemq" scripts/chaos.sh || chaos=$?
  took "short chaos matrix (the doctests beside it)"
  doc=0
  wait "$doctests" || doc=$?
  cat "$doc_log"
  rm -f "$doc_log"
  took "doctests (what was left of them)"
  [ "$doc" -eq 0 ] || { echo "test.sh: the doctests failed" >&2; exit "$doc"; }
  [ "$chaos" -eq 0 ] || { echo "test.sh: the chaos matrix failed" >&2; exit "$chaos"; }
fi
