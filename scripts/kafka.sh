#!/usr/bin/env bash
# Makes sure Apache Kafka answers on 127.0.0.1:9092 for the `kafka` tests, the
# chaos cells and the benchmark: one KRaft node (broker and controller in one
# JVM), run from its Maven Central artifacts with the machine's Java 17.
#
# Once: `mvn dependency:copy-dependencies` resolves the broker's class path
# (scripts/jvm/kafka/pom.xml) into ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/kafka/lib-VERSION.
# Every start: the data directory is wiped and formatted anew (tests use
# throwaway topics; state left by a broker killed with an earlier session
# never matters and never grows), then `java -cp … kafka.Kafka` starts in the
# background, heap capped (KAFKA_HEAP, default 1g). Idempotent: a broker that
# already answers is left alone. Log: $IDEMQ_TOOLS/kafka/kafka.log.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh

HOST=127.0.0.1
PORT=9092
CONTROLLER_PORT=9093
VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' scripts/jvm/kafka/pom.xml)"
RUN="$IDEMQ_TOOLS/kafka"
LIB="$RUN/lib-$VERSION"
DATA="$RUN/data"
CONF="$RUN/server.properties"
LOG="$RUN/kafka.log"
PIDFILE="$RUN/kafka.pid"
HEAP="${KAFKA_HEAP:-1g}"
# Any fixed KRaft cluster id will do (base64 of 16 bytes): the data
# directory is formatted anew at every start.
CLUSTER_ID=MkU3OEVBNTcwNTJENDM2Qg

started() { port_open "$HOST" "$PORT" && grep -q 'Kafka Server started' "$LOG"; }

if port_open "$HOST" "$PORT"; then
  echo "kafka: something already answers on $HOST:$PORT"
  exit 0
fi

if [ ! -f "$LIB/.complete" ]; then
  echo "kafka: resolving Apache Kafka $VERSION from Maven Central into $LIB (once)"
  rm -rf "$LIB"
  mvn -q -B -f scripts/jvm/kafka/pom.xml dependency:copy-dependencies \
    -DoutputDirectory="$LIB" -DincludeScope=runtime >"$RUN.mvn.log" 2>&1 ||
    { mkdir -p "$RUN"; show_log Kafka "$RUN.mvn.log"; echo "kafka: resolving the class path failed" >&2; exit 1; }
  touch "$LIB/.complete"
fi

mkdir -p "$RUN"
cat >"$RUN/log4j2.properties" <<'CONF'
# Warnings and errors, plus the broker's start-up line (scripts/kafka.sh waits for it).
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = OUT
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
CONF
cat >"$CONF" <<CONF
# One KRaft node for the idemq tests (scripts/kafka.sh), loopback only.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$PORT,CONTROLLER://$HOST:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$DATA
num.partitions=1
num.network.threads=2
num.io.threads=4
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# Offset commits are written at once instead of lingering to batch them
# (the default waits up to 5 ms per commit; one consumer commits per record).
group.coordinator.append.linger.ms=0
CONF

JAVA_OPTS=(-Xms256m "-Xmx$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
  -Djava.awt.headless=true "-Dlog4j2.configurationFile=$RUN/log4j2.properties")

if pid_alive "$PIDFILE"; then
  echo "kafka: the broker (pid $(live_pid "$PIDFILE")) is starting; waiting for it"
else
  rm -rf "$DATA"
  java "${JAVA_OPTS[@]}" -cp "$LIB/*" kafka.tools.StorageTool format \
    -t "$CLUSTER_ID" -c "$CONF" >"$RUN/format.log" 2>&1 ||
    { show_log Kafka "$RUN/format.log"; echo "kafka: formatting the storage failed" >&2; exit 1; }
  echo "kafka: starting Apache Kafka $VERSION on $HOST:$PORT (empty state, heap $HEAP; log $LOG)"
  spawn "$PIDFILE" "$LOG" java "${JAVA_OPTS[@]}" -cp "$LIB/*" kafka.Kafka "$CONF"
fi
wait_until Kafka 120 "$PIDFILE" "$LOG" started
echo "kafka: Apache Kafka $VERSION answers on $HOST:$PORT"
