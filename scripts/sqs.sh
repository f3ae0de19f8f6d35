#!/usr/bin/env bash
# Makes sure an SQS-compatible endpoint (moto's server, from PyPI) answers on
# 127.0.0.1:5000 for the `sqs` tests: installs `moto[server]` into a venv under
# ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/moto once, then starts it in the
# background unless something already listens there. Idempotent.
# moto keeps its state in memory: restarting it forgets every queue.
set -euo pipefail

TOOLS="${IDEMQ_TOOLS:-$HOME/.idemq-tools}"
VENV="$TOOLS/moto"
RUN="$TOOLS/sqs"
HOST=127.0.0.1
PORT=5000
LOG="$RUN/moto.log"
PIDFILE="$RUN/moto.pid"

answers() {
  # Any HTTP answer will do: moto replies to GET / without credentials.
  python3 - "$HOST" "$PORT" <<'PY' >/dev/null 2>&1
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/", timeout=2)
except urllib.error.HTTPError:
    pass  # an HTTP error status is still an answer
PY
}

listening() {
  python3 - "$HOST" "$PORT" <<'PY' >/dev/null 2>&1
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
s.close()
PY
}

if [ ! -x "$VENV/bin/moto_server" ]; then
  echo "sqs: installing moto[server] into $VENV"
  mkdir -p "$TOOLS"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet 'moto[server]'
fi

mkdir -p "$RUN"
if listening; then
  if answers; then
    echo "sqs: an endpoint already answers on http://$HOST:$PORT"
    exit 0
  fi
  echo "sqs: something listens on $HOST:$PORT but does not answer HTTP" >&2
  exit 1
fi

echo "sqs: starting moto_server on http://$HOST:$PORT (log $LOG)"
setsid nohup "$VENV/bin/moto_server" -H "$HOST" -p "$PORT" >"$LOG" 2>&1 </dev/null &
echo $! >"$PIDFILE"

for _ in $(seq 1 60); do
  if answers; then
    echo "sqs: moto answers on http://$HOST:$PORT (pid $(cat "$PIDFILE"))"
    exit 0
  fi
  if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    break
  fi
  sleep 0.5
done
echo "sqs: moto_server did not answer on $HOST:$PORT within 30 s; log tail:" >&2
tail -n 30 "$LOG" >&2 || true
exit 1
