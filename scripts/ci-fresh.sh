#!/usr/bin/env bash
# Measures .ci/run as on a fresh machine of the project's kind, on this one:
# stops every test service, purges the packages the scripts install (the
# servers, chromium, mold), deletes the apt lists, ~/.m2,
# ${IDEMQ_TOOLS:-~/.idemq-tools}, the services' data, the cargo registry
# cache, cargo-nextest and the Go module and build caches (FerretDB is built
# from nothing), then runs .ci/run in a new clone under /tmp and prints its
# time. DESTRUCTIVE for local service state: it asks for --yes-purge. Not
# part of CI.
#
#   scripts/ci-fresh.sh --yes-purge > /tmp/ci-fresh.log 2>&1
set -uo pipefail
[ "${1:-}" = --yes-purge ] || { sed -n '2,8p' "$0"; exit 2; }
cd "$(dirname "$0")/.."
repo="$(pwd)"
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh
rabbitmqctl stop >/dev/null 2>&1 || true
for f in "$IDEMQ_TOOLS"/*/*.pid; do
  [ -f "$f" ] || continue
  pid="$(live_pid "$f")" && kill -KILL "$pid" 2>/dev/null
done
pkill -9 -f 'kafka.Kafka|NamesrvStartup|BrokerStartup|moto_server|mariadbd|redis-server|mosquitto|nats-server|beam.smp|epmd' 2>/dev/null
pkill -9 -x postgres 2>/dev/null
sleep 2
DEBIAN_FRONTEND=noninteractive apt-get purge -y -q mariadb-server mariadb-client mariadb-common \
  redis-server redis-tools rabbitmq-server mosquitto nats-server libcurl4-openssl-dev \
  chromium chromium-driver mold >/tmp/ci-fresh-purge.log 2>&1
cargo uninstall cargo-nextest >/dev/null 2>&1
DEBIAN_FRONTEND=noninteractive apt-get autoremove --purge -y -q >>/tmp/ci-fresh-purge.log 2>&1
rm -rf /var/lib/apt/lists/* "$IDEMQ_TOOLS" "$HOME/.m2" /var/lib/mysql /var/lib/rabbitmq \
  /var/lib/redis /var/lib/mosquitto /var/lib/postgresql/idemq /var/lib/idemq-mariadb-tls \
  /etc/rabbitmq /etc/mysql \
  "$HOME/.cargo/registry"
if command -v go >/dev/null 2>&1; then
  go clean -modcache -cache >/dev/null 2>&1
  rm -rf "$(go env GOMODCACHE)" "$(go env GOCACHE)"
fi
rm -rf /tmp/ci-fresh && git clone -q "$repo" /tmp/ci-fresh
cd /tmp/ci-fresh
echo "ci-fresh: start $(date)"
start=$SECONDS
CI=true bash .ci/run </dev/null
code=$?
echo "ci-fresh: .ci/run exit $code in $((SECONDS - start)) s; end $(date)"
exit $code
