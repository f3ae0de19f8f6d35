#!/usr/bin/env bash
# Starts (every time; nodes that answer are left alone) a Redis Cluster of
# three masters and three replicas on 127.0.0.1:7000-7005, from the
# `redis-server` that scripts/services.sh installs, nothing kept on disk but
# each node's cluster configuration (nodes.conf). The first start creates
# the cluster (`redis-cli --cluster create … --cluster-replicas 1`); a node
# restarted later (a new session) rejoins it from its nodes.conf, empty. A
# cluster that cannot become healthy is created again from scratch. Waits
# until `CLUSTER INFO` says `cluster_state:ok` and every slot is served.
#
#   scripts/redis-cluster.sh
#
# State and logs: ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/redis-cluster/<port>/.
# The tests that use it (the cluster tests of tests/integration/redis_store.rs, the Redis Cluster suite of
# tests/integration/backends) read IDEMQ_TEST_REDIS_CLUSTER (default: the six nodes).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh

command -v redis-server >/dev/null || scripts/services.sh redis >/dev/null
PORTS="7000 7001 7002 7003 7004 7005"
ROOT="$IDEMQ_TOOLS/redis-cluster"

start_node() {
  local port="$1" dir="$ROOT/$1"
  mkdir -p "$dir"
  port_open 127.0.0.1 "$port" && return 0
  spawn_unless_alive "redis-cluster: node $port" "$ROOT/node-$port.pid" "$dir/redis.log" \
    redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" \
    --cluster-enabled yes --cluster-config-file nodes.conf \
    --cluster-node-timeout 3000 --save '' --appendonly no \
    --protected-mode no --daemonize no
}

# Replicas are counted by their flags, which read "myself,slave" for the
# node asked when it is one (as 7000 is after the failover test): counting
# " slave " found 2, and every later start waited 15 s and then wiped and
# made the cluster anew.
healthy() {
  local info
  info="$(redis-cli -p 7000 cluster info 2>/dev/null)" || return 1
  grep -q 'cluster_state:ok' <<<"$info" && grep -q 'cluster_slots_ok:16384' <<<"$info" \
    && grep -q 'cluster_known_nodes:6' <<<"$info" \
    && [ "$(redis-cli -p 7000 cluster nodes 2>/dev/null | awk '$3 ~ /(^|,)slave(,|$)/' | wc -l)" = 3 ] \
    && every_node_ok
}

# Each node's own view: a node that has not yet heard of every slot's owner
# answers CLUSTERDOWN to a client that asks it first (a test right after the
# creation failed so).
every_node_ok() {
  local port
  for port in $PORTS; do
    redis-cli -p "$port" cluster info 2>/dev/null | grep -q 'cluster_state:ok' || return 1
  done
}

wait_healthy() {
  local secs="$1"
  for _ in $(seq 1 $((secs * 2))); do
    healthy && return 0
    sleep 0.5
  done
  return 1
}

for port in $PORTS; do start_node "$port"; done
for port in $PORTS; do
  for _ in $(seq 1 40); do port_open 127.0.0.1 "$port" && break; sleep 0.25; done
  port_open 127.0.0.1 "$port" || { echo "redis-cluster: node $port did not start" >&2; tail -20 "$ROOT/$port/redis.log" >&2; exit 1; }
done

# A node that rejoins from its nodes.conf needs a few seconds to see the
# others; a fresh node (no slots assigned) means creating the cluster.
slots_assigned() {
  redis-cli -p 7000 cluster info 2>/dev/null | sed -n 's/^cluster_slots_assigned:\([0-9]*\).*/\1/p'
}
if ! healthy && ! { [ "$(slots_assigned)" = 16384 ] && wait_healthy 15; }; then
  echo "redis-cluster: creating the cluster (3 masters, 3 replicas)"
  for port in $PORTS; do
    redis-cli -p "$port" flushall >/dev/null 2>&1 || true
    redis-cli -p "$port" cluster reset hard >/dev/null
  done
  # shellcheck disable=SC2046
  redis-cli --cluster create $(for p in $PORTS; do printf '127.0.0.1:%s ' "$p"; done) \
    --cluster-replicas 1 --cluster-yes >"$ROOT/create.log" 2>&1 \
    || { echo "redis-cluster: redis-cli --cluster create failed" >&2; cat "$ROOT/create.log" >&2; exit 1; }
  wait_healthy 30 || { echo "redis-cluster: the cluster did not become healthy" >&2; redis-cli -p 7000 cluster info >&2; exit 1; }
fi
echo "redis-cluster: 127.0.0.1:7000-7005 ($(redis-cli -p 7000 cluster nodes | grep -c master) masters) is healthy"
