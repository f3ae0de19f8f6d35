#!/usr/bin/env bash
# Installs (once) and starts (every time) every service the tests use, as
# the scripts below do one by one: Debian's servers (services.sh) and
# then, needing them, the Redis Cluster and FerretDB, and chromium (apt, so
# after services.sh); Apache Kafka and Apache RocketMQ (Maven Central) and
# moto (PyPI) beside them. Prints each script's time; exits non-zero naming
# the first script that failed, with the end of its output.
set -uo pipefail
cd "$(dirname "$0")/.."
log="$(mktemp -d /tmp/idemq-services.XXXXXX)"

# step NAME SCRIPT...: runs the scripts one after another, each logged.
step() {
  local name="$1" script t0
  shift
  for script in "$@"; do
    t0=$SECONDS
    if ! "scripts/$script" >"$log/$script.log" 2>&1; then
      echo "start-services: scripts/$script failed ($name):" >&2
      tail -n 40 "$log/$script.log" >&2
      return 1
    fi
    echo "start-services: $script: $((SECONDS - t0)) s"
  done
}

step debian services.sh redis-cluster.sh chromium.sh ferretdb.sh &
debian=$!
step jvm kafka.sh rocketmq.sh &
jvm=$!
step moto sqs.sh &
moto=$!
status=0
for job in $debian $jvm $moto; do
  wait "$job" || status=1
done
rm -rf "$log"
exit $status
