#!/usr/bin/env bash
# Makes sure a RocketMQ name server answers on 127.0.0.1:9876 and a broker on
# 127.0.0.1:10911 for the `rocketmq` tests: installs rocketmq-namesrv and
# rocketmq-broker 1.0.0 with cargo once (about 12 minutes together; they need
# Rust >= 1.95) unless both are already on PATH or in ~/.cargo/bin, then
# starts them in the background in ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/rocketmq
# unless their ports already answer. Idempotent.
# Topics are auto-created by the broker (4 queues). The broker's store is
# wiped whenever this script starts it.
set -euo pipefail

TOOLS="${IDEMQ_TOOLS:-$HOME/.idemq-tools}"
RUN="$TOOLS/rocketmq"
HOST=127.0.0.1
NAMESRV_PORT=9876
BROKER_PORT=10911
HA_PORT=10912
TIMEOUT_S=90

# The broker refuses to store messages ("broker.operation.failed") when the
# disk holding its store is nearly full (about 90 %): say so up front.
mkdir -p "$TOOLS"
used=$(df -P "$TOOLS" | awk 'NR == 2 { sub("%", "", $5); print $5 }')
if [ -n "$used" ] && [ "$used" -ge 85 ]; then
  echo "rocketmq: warning: the disk holding $TOOLS is ${used}% full; the broker refuses" \
    "to store messages above about 90% (free space, e.g. old cargo target dirs)" >&2
fi

listening() {
  (exec 3<>"/dev/tcp/$HOST/$1") >/dev/null 2>&1
}

find_bin() {
  local bin
  bin="$(command -v "$1" || true)"
  if [ -z "$bin" ] && [ -x "$HOME/.cargo/bin/$1" ]; then
    bin="$HOME/.cargo/bin/$1"
  fi
  echo "$bin"
}

if listening "$NAMESRV_PORT" && listening "$BROKER_PORT"; then
  echo "rocketmq: the name server ($HOST:$NAMESRV_PORT) and the broker ($HOST:$BROKER_PORT) already answer"
  exit 0
fi

NAMESRV="$(find_bin rocketmq-namesrv-rust)"
BROKER="$(find_bin rocketmq-broker-rust)"
if [ -z "$NAMESRV" ] || [ -z "$BROKER" ]; then
  echo "rocketmq: installing rocketmq-namesrv and rocketmq-broker 1.0.0 with cargo (about 12 minutes, once)"
  export CARGO_TARGET_DIR=/tmp/rocketmq-target
  cargo install rocketmq-namesrv --version 1.0.0 --locked
  cargo install rocketmq-broker --version 1.0.0 --locked
  NAMESRV="$(find_bin rocketmq-namesrv-rust)"
  BROKER="$(find_bin rocketmq-broker-rust)"
  if [ -z "$NAMESRV" ] || [ -z "$BROKER" ]; then
    echo "rocketmq: the install did not produce rocketmq-namesrv-rust and rocketmq-broker-rust" >&2
    exit 1
  fi
fi

mkdir -p "$RUN/conf" "$RUN/store" "$RUN/logs"
cat >"$RUN/conf/broker.toml" <<EOF
[broker]
namesrvAddr = "$HOST:$NAMESRV_PORT"
brokerIp1 = "$HOST"
listenPort = $BROKER_PORT
storePathRootDir = "$RUN/store"
[broker.brokerServerConfig]
bindAddress = "$HOST"
[broker.brokerIdentity]
brokerName = "broker-a"
brokerClusterName = "DefaultCluster"
brokerId = 0
[store]
storeType = "LocalFile"
brokerRole = "ASYNC_MASTER"
storePathRootDir = "$RUN/store"
haListenAddress = "$HOST"
haListenPort = $HA_PORT
EOF

NAMESRV_LOG="$RUN/logs/namesrv.log"
NAMESRV_PID="$RUN/namesrv.pid"
BROKER_LOG="$RUN/logs/broker.log"
BROKER_PID="$RUN/broker.pid"

# True when pid file $1 names a live process whose executable is $2 (a pid
# left by a process that died with an earlier session or CI run may have been
# reused by another process, even by this script, whose command line also
# says "rocketmq").
alive() {
  local pid exe
  [ -f "$1" ] || return 1
  pid="$(cat "$1")"
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
  exe="${exe% (deleted)}"
  [ "$(basename "$exe")" = "$(basename "$2")" ]
}

fail() {
  echo "rocketmq: $1" >&2
  echo "--- the end of $NAMESRV_LOG:" >&2
  tail -n 30 "$NAMESRV_LOG" >&2 2>/dev/null || true
  echo "--- the end of $BROKER_LOG:" >&2
  tail -n 30 "$BROKER_LOG" >&2 2>/dev/null || true
  # Again last, where a truncated CI log still shows it.
  echo "rocketmq: $1" >&2
  exit 1
}

# Waits until $1 answers, as long as the process in pid file $2 (running
# executable $3) lives.
wait_for() {
  local port="$1" pidfile="$2" bin="$3" deadline=$((SECONDS + TIMEOUT_S))
  while [ "$SECONDS" -lt "$deadline" ]; do
    if listening "$port"; then
      return 0
    fi
    if ! alive "$pidfile" "$bin"; then
      return 1
    fi
    sleep 0.5
  done
  return 1
}

# Starts the name server (fresh log) unless it answers or is starting.
start_namesrv() {
  if listening "$NAMESRV_PORT"; then
    echo "rocketmq: the name server already answers on $HOST:$NAMESRV_PORT"
    return 0
  fi
  if alive "$NAMESRV_PID" "$NAMESRV"; then
    echo "rocketmq: the name server (pid $(cat "$NAMESRV_PID")) is running; waiting for its port"
  else
    rm -f "$NAMESRV_PID"
    [ -f "$NAMESRV_LOG" ] && mv -f "$NAMESRV_LOG" "$NAMESRV_LOG.prev"
    echo "rocketmq: starting the name server on $HOST:$NAMESRV_PORT (state and logs in $RUN)"
    (
      cd "$RUN"
      ROCKETMQ_HOME="$RUN" ROCKETMQ_SECURITY_PROFILE=development-insecure-loopback \
        setsid nohup "$NAMESRV" --rocketmqHome "$RUN" --listenPort "$NAMESRV_PORT" --bindAddress "$HOST" \
        >"$NAMESRV_LOG" 2>&1 </dev/null &
      echo $! >"$NAMESRV_PID"
    )
  fi
  wait_for "$NAMESRV_PORT" "$NAMESRV_PID" "$NAMESRV"
}

# Starts the broker on an empty store (fresh log) unless it answers or is
# starting. Tests use throwaway topics, so nothing is lost: a store left by a
# broker that was killed (a session or CI run ending) made the next start
# fail in recovery ("Service lifecycle operation failed"), and it only grows.
# The broker's default store (~/store) is wiped too, in case a version
# ignores storePathRootDir.
start_broker() {
  if listening "$BROKER_PORT"; then
    echo "rocketmq: the broker already answers on $HOST:$BROKER_PORT"
    return 0
  fi
  if alive "$BROKER_PID" "$BROKER"; then
    echo "rocketmq: the broker (pid $(cat "$BROKER_PID")) is running; waiting for its port"
  else
    rm -f "$BROKER_PID"
    rm -rf "$RUN/store" "$HOME/store"
    mkdir -p "$RUN/store"
    [ -f "$BROKER_LOG" ] && mv -f "$BROKER_LOG" "$BROKER_LOG.prev"
    echo "rocketmq: starting the broker on $HOST:$BROKER_PORT (empty store)"
    (
      cd "$RUN"
      ROCKETMQ_HOME="$RUN" setsid nohup "$BROKER" -c "$RUN/conf/broker.toml" -n "$HOST:$NAMESRV_PORT" \
        >"$BROKER_LOG" 2>&1 </dev/null &
      echo $! >"$BROKER_PID"
    )
  fi
  wait_for "$BROKER_PORT" "$BROKER_PID" "$BROKER" || return 1
  # The broker registers with the name server right after it starts
  # listening (and every 30 s after); give the first registration a moment.
  sleep 5
}

# Stops whatever this script started (by pid file and executable).
stop_all() {
  local pidfile bin
  for pair in "$BROKER_PID:$BROKER" "$NAMESRV_PID:$NAMESRV"; do
    pidfile="${pair%%:*}"
    bin="${pair#*:}"
    if alive "$pidfile" "$bin"; then
      kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    fi
    rm -f "$pidfile"
  done
  sleep 1
}

# One retry from scratch: a first start on a machine restored from a
# snapshot has failed in ways a clean second start did not.
for try in 1 2; do
  if start_namesrv && start_broker && listening "$NAMESRV_PORT" && listening "$BROKER_PORT"; then
    echo "rocketmq: name server $HOST:$NAMESRV_PORT and broker $HOST:$BROKER_PORT answer"
    exit 0
  fi
  if [ "$try" = 1 ]; then
    echo "rocketmq: the servers did not come up; the ends of their logs, then one more try from scratch:" >&2
    tail -n 15 "$NAMESRV_LOG" >&2 2>/dev/null || true
    tail -n 15 "$BROKER_LOG" >&2 2>/dev/null || true
    stop_all
  fi
done
fail "the name server ($HOST:$NAMESRV_PORT) or the broker ($HOST:$BROKER_PORT) did not come up"
