#!/usr/bin/env bash
# Makes sure Apache RocketMQ answers for the `rocketmq` tests, the chaos cells
# and the benchmark: a name server on 127.0.0.1:9876 and one broker on
# 127.0.0.1:10911, run from their Maven Central artifacts with the machine's
# Java 17.
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

if port_open "$HOST" "$NAMESRV_PORT" && port_open "$HOST" "$BROKER_PORT"; then
  echo "rocketmq: the name server ($HOST:$NAMESRV_PORT) and the broker ($HOST:$BROKER_PORT) already answer"
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

cat >"$RUN/namesrv.conf" <<CONF
listenPort=$NAMESRV_PORT
bindAddress=$HOST
CONF
cat >"$RUN/broker.conf" <<CONF
brokerClusterName=DefaultCluster
brokerName=broker-a
brokerId=0
brokerRole=ASYNC_MASTER
flushDiskType=ASYNC_FLUSH
namesrvAddr=$HOST:$NAMESRV_PORT
brokerIP1=$HOST
bindAddress=$HOST
listenPort=$BROKER_PORT
storePathRootDir=$RUN/store
storePathCommitLog=$RUN/store/commitlog
autoCreateTopicEnable=true
autoCreateSubscriptionGroup=true
defaultTopicQueueNums=4
mappedFileSizeCommitLog=134217728
diskMaxUsedSpaceRatio=95
CONF

# Java 17 needs these for RocketMQ's direct-buffer and reflection use.
JAVA_COMMON=(-XX:+UseG1GC -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true
  "-Duser.home=$RUN" "-Drocketmq.home.dir=$RUN"
  --add-opens=java.base/java.nio=ALL-UNNAMED --add-opens=java.base/sun.nio.ch=ALL-UNNAMED
  --add-opens=java.base/java.lang=ALL-UNNAMED --add-opens=java.base/jdk.internal.misc=ALL-UNNAMED
  --add-exports=java.base/sun.nio.ch=ALL-UNNAMED --add-exports=java.base/jdk.internal.ref=ALL-UNNAMED)
export ROCKETMQ_HOME="$RUN"

namesrv_ready() { port_open "$HOST" "$NAMESRV_PORT"; }
broker_ready() { port_open "$HOST" "$BROKER_PORT" && grep -q 'boot success' "$BROKER_LOG"; }

if ! namesrv_ready; then
  if pid_alive "$NAMESRV_PID"; then
    echo "rocketmq: the name server (pid $(live_pid "$NAMESRV_PID")) is starting; waiting for it"
  else
    echo "rocketmq: starting the Apache RocketMQ $VERSION name server on $HOST:$NAMESRV_PORT (log $NAMESRV_LOG)"
    spawn "$NAMESRV_PID" "$NAMESRV_LOG" java -Xms128m "-Xmx${ROCKETMQ_NAMESRV_HEAP:-256m}" "${JAVA_COMMON[@]}" \
      -cp "$LIB/*" org.apache.rocketmq.namesrv.NamesrvStartup -c "$RUN/namesrv.conf"
  fi
fi
wait_until "RocketMQ name server" 90 "$NAMESRV_PID" "$NAMESRV_LOG" namesrv_ready

if ! port_open "$HOST" "$BROKER_PORT"; then
  if pid_alive "$BROKER_PID"; then
    echo "rocketmq: the broker (pid $(live_pid "$BROKER_PID")) is starting; waiting for it"
  else
    rm -rf "$RUN/store"
    mkdir -p "$RUN/store"
    echo "rocketmq: starting the Apache RocketMQ $VERSION broker on $HOST:$BROKER_PORT (empty store; log $BROKER_LOG)"
    spawn "$BROKER_PID" "$BROKER_LOG" java -Xms256m "-Xmx${ROCKETMQ_BROKER_HEAP:-768m}" \
      -XX:MaxDirectMemorySize=512m "${JAVA_COMMON[@]}" \
      -cp "$LIB/*" org.apache.rocketmq.broker.BrokerStartup -c "$RUN/broker.conf" -n "$HOST:$NAMESRV_PORT"
  fi
fi
wait_until "RocketMQ broker" 120 "$BROKER_PID" "$BROKER_LOG" broker_ready
echo "rocketmq: Apache RocketMQ $VERSION: name server $HOST:$NAMESRV_PORT and broker $HOST:$BROKER_PORT answer"
