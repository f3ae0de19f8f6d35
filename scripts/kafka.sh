#!/usr/bin/env bash
# Makes sure Apache Kafka answers on 127.0.0.1:9092 for the `kafka` tests, the
# chaos cells and the benchmark: one KRaft node (broker and controller in one
# JVM), run from its Maven Central artifacts with the machine's Java 17.
#
# Once: `mvn dependency:copy-dependencies` resolves the broker's class path
# (scripts/jvm/kafka/pom.xml) into ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/kafka/lib-VERSION.
# TLS and authentication (for tests/integration/tls.rs), beside plain :9092:
#   :9094 SASL_SSL, mechanisms PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512, user
#         idemq with password idemq-secret (SCRAM credentials written when
#         the storage is formatted);
#   :9095 SSL asking for a client certificate (mutual TLS).
# Both serve a certificate for localhost signed by a local CA; clients verify
# with $IDEMQ_TOOLS/kafka/root.crt and prove themselves with
# $IDEMQ_TOOLS/kafka/client.{crt,key}.
# Every start: the data directory is wiped and formatted anew (tests use
# throwaway topics; state left by a broker killed with an earlier session
# never matters and never grows), then `java -cp … kafka.Kafka` starts in the
# background, heap capped (KAFKA_HEAP, default 1g). Idempotent: a broker that
# already answers is left alone, unless it is ours and was started with
# another configuration than this script's (then it starts again with this
# one). Log: $IDEMQ_TOOLS/kafka/kafka.log.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh
# shellcheck source=scripts/lib/tls.sh
. scripts/lib/tls.sh

HOST=127.0.0.1
PORT=9092
CONTROLLER_PORT=9093
SASL_SSL_PORT=9094
SSL_PORT=9095
SASL_USER=idemq
SASL_PASSWORD=idemq-secret
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

mkdir -p "$RUN"
TLS="$RUN/tls"
tls_cert "$TLS" "$(id -un)"
tls_client_cert "$TLS" "$(id -un)" "$RUN"
cp -f "$TLS/ca.crt" "$RUN/root.crt"
# Kafka reads a PEM key store as one file: the private key, then its chain.
cat "$TLS/server.key" "$TLS/server.crt" >"$TLS/server.pem"
chmod 600 "$TLS/server.pem"
started() { port_open "$HOST" "$PORT" && port_open "$HOST" "$SSL_PORT" && grep -q 'Kafka Server started' "$LOG"; }

# A broker that is not ours is left alone, before anything is resolved.
if port_open "$HOST" "$PORT" && ! pid_alive "$PIDFILE"; then
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
cat >"$CONF.new" <<CONF
# One KRaft node for the idemq tests (scripts/kafka.sh), loopback only.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$PORT,CONTROLLER://$HOST:$CONTROLLER_PORT,SASL_SSL://$HOST:$SASL_SSL_PORT,SSL://$HOST:$SSL_PORT
advertised.listeners=PLAINTEXT://$HOST:$PORT,SASL_SSL://localhost:$SASL_SSL_PORT,SSL://localhost:$SSL_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL
ssl.keystore.type=PEM
ssl.keystore.location=$TLS/server.pem
ssl.truststore.type=PEM
ssl.truststore.location=$TLS/ca.crt
listener.name.ssl.ssl.client.auth=required
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$SASL_USER="$SASL_PASSWORD";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
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
# Consumers may ask for session timeouts down to 1 s (the default floor is
# 6 s): the chaos matrix's Kafka cells kill a consumer 20 times, and the
# group waits out the dead member's session before it rebalances.
group.min.session.timeout.ms=1000
# Offset commits are written at once instead of lingering to batch them
# (the default waits up to 5 ms per commit; one consumer commits per record).
group.coordinator.append.linger.ms=0
CONF

# Ours and answering: left alone, unless it was started with another
# configuration (an older version of this script); then it is started
# again with this one.
if port_open "$HOST" "$PORT"; then
  if port_open "$HOST" "$SASL_SSL_PORT" && cmp -s "$CONF.new" "$CONF"; then
    echo "kafka: the broker (pid $(live_pid "$PIDFILE")) already answers on $HOST:$PORT"
    rm -f "$CONF.new"
    exit 0
  fi
  echo "kafka: restarting the broker (pid $(live_pid "$PIDFILE")) with this script's configuration"
  kill "$(live_pid "$PIDFILE")"
  for _ in $(seq 1 300); do pid_alive "$PIDFILE" || break; sleep 0.1; done
fi
mv -f "$CONF.new" "$CONF"

JAVA_OPTS=(-Xms256m "-Xmx$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
  -Djava.awt.headless=true "-Dlog4j2.configurationFile=$RUN/log4j2.properties")

if pid_alive "$PIDFILE"; then
  echo "kafka: the broker (pid $(live_pid "$PIDFILE")) is starting; waiting for it"
else
  rm -rf "$DATA"
  java "${JAVA_OPTS[@]}" -cp "$LIB/*" kafka.tools.StorageTool format \
    -t "$CLUSTER_ID" -c "$CONF" \
    --add-scram "SCRAM-SHA-256=[name=$SASL_USER,password=$SASL_PASSWORD]" \
    --add-scram "SCRAM-SHA-512=[name=$SASL_USER,password=$SASL_PASSWORD]" >"$RUN/format.log" 2>&1 ||
    { show_log Kafka "$RUN/format.log"; echo "kafka: formatting the storage failed" >&2; exit 1; }
  echo "kafka: starting Apache Kafka $VERSION on $HOST:$PORT (empty state, heap $HEAP; log $LOG)"
  spawn "$PIDFILE" "$LOG" java "${JAVA_OPTS[@]}" -cp "$LIB/*" kafka.Kafka "$CONF"
fi
wait_until Kafka 120 "$PIDFILE" "$LOG" started
echo "kafka: Apache Kafka $VERSION answers on $HOST:$PORT (SASL_SSL :$SASL_SSL_PORT, mutual TLS :$SSL_PORT)"
