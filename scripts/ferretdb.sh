#!/usr/bin/env bash
# Makes sure a MongoDB-wire server answers on 127.0.0.1:27017 for the
# `mongodb` tests (the Mongo store suite of tests/integration/backends, the CLI): FerretDB
# v1 (Apache-2.0), which speaks the MongoDB wire protocol over PostgreSQL.
#
# Once: FerretDB is built from the Go module proxy into
# ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/ferretdb/ferretdb-VERSION (1.5 to 3.5 min on
# 2 cores). `go install` cannot build it directly: its build/version package
# embeds a version.txt that the project generates from git, so the module's
# source is downloaded (`go mod download`), copied somewhere writable, given a
# version.txt, and built there.
#
# Every time: PostgreSQL is started (scripts/services.sh postgres) and the
# database `ferretdb` created in it if missing; FerretDB starts in the
# background unless something already answers on the port, and the script
# waits until it answers a `hello`. Why PostgreSQL and not FerretDB's SQLite
# handler: the store's exactly-once decisions rest on unique indexes
# (PostgreSQL's unique indexes arbitrate concurrent inserts from many
# connections without SQLITE_BUSY failures; see docs in
# crates/idemq/src/store/mongo/mod.rs). State lives in PostgreSQL (schema per
# MongoDB database), so it survives restarts of FerretDB.
#
#   scripts/ferretdb.sh                      # start (install once)
#   FERRETDB_PORT=27018 scripts/ferretdb.sh  # another port
#
# Log: $IDEMQ_TOOLS/ferretdb/ferretdb.log. Tests read IDEMQ_TEST_MONGODB
# (default mongodb://127.0.0.1:27017).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh

VERSION=v1.24.2
MODULE=github.com/FerretDB/FerretDB
HOST=127.0.0.1
PORT="${FERRETDB_PORT:-27017}"
RUN="$IDEMQ_TOOLS/ferretdb"
BIN="$RUN/ferretdb-$VERSION"
LOG="$RUN/ferretdb.log"
PIDFILE="$RUN/ferretdb.pid"
PG_URL="postgres://postgres@127.0.0.1:5432/ferretdb"

# True when the server on HOST:PORT answers an OP_MSG `hello` with ok: 1.
answers() {
  python3 - "$HOST" "$PORT" <<'PY' >/dev/null 2>&1
import socket, struct, sys
def cstring(s): return s.encode() + b"\0"
def bson(fields):
    body = b""
    for name, value in fields:
        if isinstance(value, int):
            body += b"\x10" + cstring(name) + struct.pack("<i", value)
        else:
            data = value.encode() + b"\0"
            body += b"\x02" + cstring(name) + struct.pack("<i", len(data)) + data
    return struct.pack("<i", len(body) + 5) + body + b"\0"
doc = bson([("hello", 1), ("$db", "admin")])
msg = struct.pack("<I", 0) + b"\0" + doc
header = struct.pack("<iiii", 16 + len(msg), 1, 0, 2013)
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:
    s.sendall(header + msg)
    reply = b""
    while len(reply) < 4 or len(reply) < struct.unpack("<i", reply[:4])[0]:
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
# `ok` as a double 1.0 in the reply document.
sys.exit(0 if b"\x01ok\x00" + struct.pack("<d", 1.0) in reply else 1)
PY
}

install_ferretdb() {
  [ -x "$BIN" ] && return 0
  command -v go >/dev/null || { echo "ferretdb: Go is needed to build FerretDB (not found)" >&2; return 1; }
  echo "ferretdb: building FerretDB $VERSION from the Go module proxy into $BIN (once, 1.5-3.5 min)"
  mkdir -p "$RUN"
  local src work
  src="$(GOFLAGS=-mod=mod go mod download -json "$MODULE@$VERSION" 2>"$RUN/build.log" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')" ||
    { show_log FerretDB "$RUN/build.log"; echo "ferretdb: downloading $MODULE@$VERSION failed" >&2; return 1; }
  work="$(mktemp -d "$RUN/src.XXXXXX")"
  cp -r "$src/." "$work/"
  chmod -R u+w "$work"
  echo "$VERSION" >"$work/build/version/version.txt"
  (cd "$work" && GOFLAGS=-mod=mod go build -trimpath -o "$BIN.tmp" ./cmd/ferretdb) >>"$RUN/build.log" 2>&1 ||
    { rm -rf "$work"; show_log FerretDB "$RUN/build.log"; echo "ferretdb: building FerretDB failed" >&2; return 1; }
  mv -f "$BIN.tmp" "$BIN"
  rm -rf "$work"
}

mkdir -p "$RUN"
if port_open "$HOST" "$PORT"; then
  if answers; then
    echo "ferretdb: a MongoDB-wire server already answers on $HOST:$PORT"
    exit 0
  fi
  if ! pid_alive "$PIDFILE"; then
    echo "ferretdb: something listens on $HOST:$PORT but does not answer a MongoDB hello" >&2
    exit 1
  fi
fi

install_ferretdb
scripts/services.sh postgres >/dev/null
if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'ferretdb'" | grep -q 1; then
  psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE ferretdb"
fi

spawn_unless_alive "ferretdb: FerretDB $VERSION on $HOST:$PORT" "$PIDFILE" "$LOG" \
  "$BIN" --handler=postgresql --postgresql-url="$PG_URL" \
  --listen-addr="$HOST:$PORT" --debug-addr=- --state-dir="$RUN" \
  --telemetry=disable --log-level=error
wait_until FerretDB 60 "$PIDFILE" "$LOG" answers
echo "ferretdb: FerretDB $VERSION answers on mongodb://$HOST:$PORT (PostgreSQL database ferretdb)"
