#!/usr/bin/env bash
# Makes sure Apache RocketMQ answers for the `rocketmq` tests, the chaos cells
# and the benchmark: a name server on 127.0.0.1:9876 and one broker on
# 127.0.0.1:10911, run from their Maven Central artifacts with the machine's
# Java 17; and a second pair with authentication on (ACL 2.0) for the ACL
# tests: name server 127.0.0.1:9877, broker 127.0.0.1:10921, user idemq with
# password (secret key) idemq-secret.
#
# Once: `mvn dependency:copy-dependencies` resolves their class path
# (scripts/jvm/rocketmq/pom.xml) into ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/rocketmq/lib-VERSION.
# Every start of the broker: its store is wiped (tests use throwaway topics;
# a store left by a broker killed with an earlier session never matters and
# never grows). Topics are auto-created with 4 queues. Heaps are capped
# (ROCKETMQ_NAMESRV_HEAP 256m, ROCKETMQ_BROKER_HEAP 768m). Idempotent: what
# already answers is left alone. Logs: $IDEMQ_TOOLS/rocketmq/*.log (start-up)
# and $IDEMQ_TOOLS/rocketmq/logs/rocketmqlogs/ (the servers' own).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh

HOST=127.0.0.1
NAMESRV_PORT=9876
BROKER_PORT=10911
VERSION="$(sed -n 's:.*<rocketmq.version>\(.*\)</rocketmq.version>.*:\1:p' scripts/jvm/rocketmq/pom.xml)"
RUN="$IDEMQ_TOOLS/rocketmq"
LIB="$RUN/lib-$VERSION"
NAMESRV_PID="$RUN/namesrv.pid"
NAMESRV_LOG="$RUN/namesrv.log"
BROKER_PID="$RUN/broker.pid"
BROKER_LOG="$RUN/broker.log"

ACL_NAMESRV_PORT=9877
ACL_BROKER_PORT=10921
ACL_USER=idemq
ACL_PASSWORD=idemq-secret

if port_open "$HOST" "$NAMESRV_PORT" && port_open "$HOST" "$BROKER_PORT" &&
  port_open "$HOST" "$ACL_NAMESRV_PORT" && port_open "$HOST" "$ACL_BROKER_PORT"; then
  echo "rocketmq: the name servers ($HOST:$NAMESRV_PORT, $HOST:$ACL_NAMESRV_PORT) and the brokers ($HOST:$BROKER_PORT, $HOST:$ACL_BROKER_PORT) already answer"
  exit 0
fi

# The broker refuses to store messages when the disk holding its store is
# nearly full: say so up front.
mkdir -p "$RUN"
used=$(df -P "$RUN" | awk 'NR == 2 { sub("%", "", $5); print $5 }')
if [ -n "$used" ] && [ "$used" -ge 85 ]; then
  echo "rocketmq: warning: the disk holding $RUN is ${used}% full; the broker refuses to store messages near full" >&2
fi

if [ ! -f "$LIB/.complete" ]; then
  echo "rocketmq: resolving Apache RocketMQ $VERSION from Maven Central into $LIB (once)"
  rm -rf "$LIB"
  mvn -q -B -f scripts/jvm/rocketmq/pom.xml dependency:copy-dependencies \
    -DoutputDirectory="$LIB" -DincludeScope=runtime >"$RUN/mvn.log" 2>&1 ||
    { show_log RocketMQ "$RUN/mvn.log"; echo "rocketmq: resolving the class path failed" >&2; exit 1; }
  touch "$LIB/.complete"
fi

# name_conf NAME PORT: the configuration of name server NAME.
name_conf() {
  cat >"$RUN/$1.conf" <<CONF
listenPort=$2
bindAddress=$HOST
CONF
}
# broker_conf NAME BROKER_PORT NAMESRV_PORT [EXTRA…]: the configuration of
# broker NAME, with its own store; each EXTRA is one more line. The commit
# log is kept 96 h (not the default 72 h), which the tests read back as the
# source's redelivery horizon. Off: the timer wheel (messages with an
# arbitrary delivery time, which idemq does not send: its retries use the
# delay levels, which the schedule service serves) and the fast-failure
# sweeper; their threads poll every few milliseconds and kept an idle
# broker at about a tenth of a core.
broker_conf() {
  local name=$1 port=$2 namesrv=$3
  shift 3
  {
    cat <<CONF
brokerClusterName=${name}Cluster
brokerName=$name
brokerId=0
brokerRole=ASYNC_MASTER
flushDiskType=ASYNC_FLUSH
namesrvAddr=$HOST:$namesrv
brokerIP1=$HOST
bindAddress=$HOST
listenPort=$port
storePathRootDir=$RUN/$name-store
storePathCommitLog=$RUN/$name-store/commitlog
autoCreateTopicEnable=true
autoCreateSubscriptionGroup=true
defaultTopicQueueNums=4
mappedFileSizeCommitLog=134217728
diskMaxUsedSpaceRatio=95
fileReservedTime=96
timerWheelEnable=false
brokerFastFailureEnable=false
CONF
    printf '%s\n' "$@"
  } >"$RUN/$name.conf"
}

# Java 17 needs these for RocketMQ's direct-buffer and reflection use.
JAVA_COMMON=(-XX:+UseG1GC -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true
  "-Drocketmq.home.dir=$RUN"
  --add-opens=java.base/java.nio=ALL-UNNAMED --add-opens=java.base/sun.nio.ch=ALL-UNNAMED
  --add-opens=java.base/java.lang=ALL-UNNAMED --add-opens=java.base/jdk.internal.misc=ALL-UNNAMED
  --add-exports=java.base/sun.nio.ch=ALL-UNNAMED --add-exports=java.base/jdk.internal.ref=ALL-UNNAMED)
export ROCKETMQ_HOME="$RUN"
# Where server NAME keeps its own logs (HOME/logs/rocketmqlogs): $RUN for
# the plain pair, $RUN/acl for the pair with authentication.
home_of() { case $1 in acl-*) echo "$RUN/acl" ;; *) echo "$RUN" ;; esac; }

# start_namesrv NAME PORT: starts name server NAME unless it answers.
start_namesrv() {
  local name=$1 port=$2
  port_open "$HOST" "$port" && return 0
  if pid_alive "$RUN/$name.pid"; then
    echo "rocketmq: the name server $name (pid $(live_pid "$RUN/$name.pid")) is starting; waiting for it"
  else
    name_conf "$name" "$port"
    echo "rocketmq: starting the Apache RocketMQ $VERSION name server on $HOST:$port (log $RUN/$name.log)"
    spawn "$RUN/$name.pid" "$RUN/$name.log" java -Xms128m "-Xmx${ROCKETMQ_NAMESRV_HEAP:-256m}" "${JAVA_COMMON[@]}" "-Duser.home=$(home_of "$name")" \
      -cp "$LIB/*" org.apache.rocketmq.namesrv.NamesrvStartup -c "$RUN/$name.conf"
  fi
}
# start_broker NAME PORT NAMESRV_PORT HEAP [EXTRA…]: starts broker NAME with
# an empty store unless it answers.
start_broker() {
  local name=$1 port=$2 namesrv=$3 heap=$4
  shift 4
  port_open "$HOST" "$port" && return 0
  if pid_alive "$RUN/$name.pid"; then
    echo "rocketmq: the broker $name (pid $(live_pid "$RUN/$name.pid")) is starting; waiting for it"
  else
    broker_conf "$name" "$port" "$namesrv" "$@"
    rm -rf "$RUN/$name-store"
    mkdir -p "$RUN/$name-store"
    echo "rocketmq: starting the Apache RocketMQ $VERSION broker on $HOST:$port (empty store; log $RUN/$name.log)"
    spawn "$RUN/$name.pid" "$RUN/$name.log" java -Xms256m "-Xmx$heap" \
      -XX:MaxDirectMemorySize=512m "${JAVA_COMMON[@]}" "-Duser.home=$(home_of "$name")" \
      -cp "$LIB/*" org.apache.rocketmq.broker.BrokerStartup -c "$RUN/$name.conf" -n "$HOST:$namesrv"
  fi
}
answers() { port_open "$HOST" "$1"; }
booted() { port_open "$HOST" "$1" && grep -q 'boot success' "$RUN/$2.log"; }

start_namesrv namesrv "$NAMESRV_PORT"
start_namesrv acl-namesrv "$ACL_NAMESRV_PORT"
wait_until "RocketMQ name server" 90 "$RUN/namesrv.pid" "$RUN/namesrv.log" answers "$NAMESRV_PORT"
wait_until "RocketMQ name server (ACL)" 90 "$RUN/acl-namesrv.pid" "$RUN/acl-namesrv.log" answers "$ACL_NAMESRV_PORT"
start_broker broker "$BROKER_PORT" "$NAMESRV_PORT" "${ROCKETMQ_BROKER_HEAP:-768m}"
# Authentication (ACL 2.0): every request signed by a known user; the user
# is made at start-up in the broker's own metadata store (kept with its store).
start_broker acl-broker "$ACL_BROKER_PORT" "$ACL_NAMESRV_PORT" "${ROCKETMQ_ACL_BROKER_HEAP:-384m}" \
  authenticationEnabled=true \
  authenticationProvider=org.apache.rocketmq.auth.authentication.provider.DefaultAuthenticationProvider \
  authenticationMetadataProvider=org.apache.rocketmq.auth.authentication.provider.LocalAuthenticationMetadataProvider \
  "authConfigPath=$RUN/acl-broker-store/auth" \
  "initAuthenticationUser={\"username\":\"$ACL_USER\",\"password\":\"$ACL_PASSWORD\"}" \
  "innerClientAuthenticationCredentials={\"accessKey\":\"$ACL_USER\",\"secretKey\":\"$ACL_PASSWORD\"}"
wait_until "RocketMQ broker" 120 "$RUN/broker.pid" "$RUN/broker.log" booted "$BROKER_PORT" broker
wait_until "RocketMQ broker (ACL)" 120 "$RUN/acl-broker.pid" "$RUN/acl-broker.log" booted "$ACL_BROKER_PORT" acl-broker
echo "rocketmq: Apache RocketMQ $VERSION: name server $HOST:$NAMESRV_PORT and broker $HOST:$BROKER_PORT answer; with authentication, $HOST:$ACL_NAMESRV_PORT and $HOST:$ACL_BROKER_PORT"
