#!/usr/bin/env bash
# Makes sure a Kafka-compatible broker answers on 127.0.0.1:9092 for the
# `kafka` tests: installs tansu 0.6.0 (SQLite storage engine) with cargo once,
# unless `tansu` is already on PATH or in ~/.cargo/bin, then starts it in the
# background in ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/kafka unless something
# already listens on the port. Idempotent.
# Topics are not auto-created by tansu: the tests create theirs.
set -euo pipefail

TOOLS="${IDEMQ_TOOLS:-$HOME/.idemq-tools}"
RUN="$TOOLS/kafka"
HOST=127.0.0.1
PORT=9092
LOG="$RUN/tansu.log"
PIDFILE="$RUN/tansu.pid"

# True when the pid file names a live process running the tansu executable
# (a pid left by a process that died with an earlier session may have been
# reused, even by a process whose command line says "tansu").
alive() {
  local pid exe
  [ -f "$PIDFILE" ] || return 1
  pid="$(cat "$PIDFILE")"
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
  exe="${exe% (deleted)}"
  [ "$(basename "$exe")" = tansu ]
}

listening() {
  (exec 3<>"/dev/tcp/$HOST/$PORT") >/dev/null 2>&1
}

if listening; then
  echo "kafka: something already listens on $HOST:$PORT"
  exit 0
fi

TANSU="$(command -v tansu || true)"
if [ -z "$TANSU" ] && [ -x "$HOME/.cargo/bin/tansu" ]; then
  TANSU="$HOME/.cargo/bin/tansu"
fi
if [ -z "$TANSU" ]; then
  echo "kafka: installing tansu 0.6.0 with cargo (about 12 minutes, once)"
  CARGO_TARGET_DIR=/tmp/tansu-target cargo install tansu --version 0.6.0 --locked --features libsql
  TANSU="$HOME/.cargo/bin/tansu"
fi

mkdir -p "$RUN"
if alive; then
  echo "kafka: tansu (pid $(cat "$PIDFILE")) is running; waiting for its port"
else
  # Tests use throwaway topics: start on an empty database, so state left by
  # a broker that was killed (a session or CI run ending) never matters and
  # never grows.
  rm -f "$RUN"/tansu.db "$RUN"/tansu.db-* "$PIDFILE"
  [ -f "$LOG" ] && mv -f "$LOG" "$LOG.prev"
  echo "kafka: starting tansu on $HOST:$PORT (empty state; log in $RUN)"
  (
    cd "$RUN"
    setsid nohup "$TANSU" broker \
      --listener-url "tcp://$HOST:$PORT" \
      --advertised-listener-url "tcp://$HOST:$PORT" \
      --storage-engine sqlite://tansu.db \
      >"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
  )
fi

for _ in $(seq 1 120); do
  if listening; then
    echo "kafka: tansu answers on $HOST:$PORT"
    exit 0
  fi
  if ! alive; then
    break
  fi
  sleep 0.5
done
echo "kafka: tansu does not listen on $HOST:$PORT; the end of $LOG:" >&2
tail -n 30 "$LOG" >&2 || true
exit 1
