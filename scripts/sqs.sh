#!/usr/bin/env bash
# Makes sure an SQS endpoint (moto's server, from PyPI) answers on
# 127.0.0.1:5000 for the `sqs` tests: installs `moto[server]` into a venv under
# ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/moto once, then starts it in the
# background unless something already answers there. Idempotent.
# moto keeps its state in memory: restarting it forgets every queue.
# Log: $IDEMQ_TOOLS/sqs/moto.log.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh

VENV="$IDEMQ_TOOLS/moto"
RUN="$IDEMQ_TOOLS/sqs"
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

mkdir -p "$RUN"
if [ ! -x "$VENV/bin/moto_server" ]; then
  echo "sqs: installing moto[server] from PyPI into $VENV (once)"
  rm -rf "$VENV"
  { python3 -m venv "$VENV" && "$VENV/bin/pip" install --quiet 'moto[server]==5.2.5'; } >"$RUN/install.log" 2>&1 ||
    { show_log SQS "$RUN/install.log"; echo "sqs: installing moto[server] failed" >&2; exit 1; }
fi

if port_open "$HOST" "$PORT" && pid_alive "$PIDFILE" &&
  ! tr '\0' ' ' <"/proc/$(live_pid "$PIDFILE")/cmdline" | grep -q moto-server.py; then
  # Ours, started by an older version of this script: again, as below.
  echo "sqs: restarting moto (pid $(live_pid "$PIDFILE")) through scripts/moto-server.py"
  stop_pid "$PIDFILE"
fi
if port_open "$HOST" "$PORT"; then
  if answers; then
    echo "sqs: an endpoint already answers on http://$HOST:$PORT"
    exit 0
  fi
  echo "sqs: something listens on $HOST:$PORT but does not answer HTTP" >&2
  exit 1
fi

# moto's server through scripts/moto-server.py, which makes three hot spots of
# moto 5.2.5 cheap (the clock read per message on every send; a FIFO long
# poll re-scanning at once; a directory listing per request) without
# changing what SQS does.
spawn_unless_alive "sqs: moto_server on http://$HOST:$PORT" "$PIDFILE" "$LOG" \
  "$VENV/bin/python3" scripts/moto-server.py -H "$HOST" -p "$PORT"
wait_until "SQS (moto)" 60 "$PIDFILE" "$LOG" answers
echo "sqs: moto answers on http://$HOST:$PORT"
