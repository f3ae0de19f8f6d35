#!/usr/bin/env bash
# The chaos matrix: `idemq chaos` (built with the `failpoints` feature) per
# (source, store) cell, ~2,000 orders and >= 20 kills per cell (20 random
# SIGKILLs plus the kills at the named fail points).
#
#   scripts/chaos.sh            the short matrix: every source × PostgreSQL,
#                               plus the JSON-lines file × every other store
#                               and RabbitMQ × every other store, plus batch
#                               mode (JSON lines, RabbitMQ) and
#                               offset-watermark mode (Kafka) × PostgreSQL,
#                               and watermark mode with concurrent records
#                               (Kafka) × MariaDB, and lease batches
#                               (JSON lines × Redis); "every other store"
#                               includes MongoDB (FerretDB, scripts/ferretdb.sh)
#                               and postgres-part / mysql-part, PostgreSQL /
#                               MariaDB with a time-partitioned inbox of 2 s
#                               partitions
#   scripts/chaos.sh --full     every source × every store (56 cells), plus
#                               the batch and both watermark cells × every SQL store
#                               and the batch cells × Redis and MongoDB (lease batches)
#   scripts/chaos.sh --cells 'jsonl:sqlite amqp:redis kafka:mysql:watermark'
#                               chosen cells (SOURCE:STORE[:batch|:watermark|:concurrent])
#
# Five cells also restart their database or broker once mid-run (see
# restart_args; CHAOS_RESTARTS=0 turns that off).
#
# The five cells that restart a service run first, alone; the others run
# CHAOS_PARALLEL at once (default 1: on 2 cores two at a time took 668 s
# against 597-664 s one at a time, the cells being CPU-bound), each with its
# own topics, queues, tables, SQLite file and metrics ports. A cell's output
# is printed when it ends.
#
# Environment: CHAOS_MESSAGES (2000), CHAOS_KILLS (20), CHAOS_WORKERS (3),
# CHAOS_ARGS (extra `idemq chaos` flags), CHAOS_BIN (a prebuilt binary), CHAOS_DIR (work directory, default
# a new one under /tmp), CHAOS_REPORT (the Markdown table, default
# $CHAOS_DIR/report.md). The services are expected to run already
# (scripts/services.sh, kafka.sh, sqs.sh, rocketmq.sh); a cell whose broker
# or store is down fails, the others run.
#
# moto, the local SQS, serves about one message a second to three consumers
# on a busy two-core machine: SQS cells publish CHAOS_SQS_MESSAGES (300).
# MQTT cells are the load of issue 21 that lost 1,260 of 3,000 orders under
# Mosquitto's default max_queued_messages (1000): CHAOS_MQTT_MESSAGES (3000)
# QoS 1 orders published at full speed to 2 workers on a shared
# subscription, so that a broker queue limit that drops messages fails the
# cell (scripts/services.sh starts Mosquitto without one).
#
# Exit status: 0 when every cell passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=short
cells=""
while [ $# -gt 0 ]; do
  case "$1" in
    --full) mode=full ;;
    --cells) cells="$2"; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "chaos.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

MESSAGES="${CHAOS_MESSAGES:-2000}"
KILLS="${CHAOS_KILLS:-20}"
WORKERS="${CHAOS_WORKERS:-3}"
PARALLEL="${CHAOS_PARALLEL:-1}"
DIR="${CHAOS_DIR:-$(mktemp -d /tmp/idemq-chaos.XXXXXX)}"
REPORT="${CHAOS_REPORT:-$DIR/report.md}"
mkdir -p "$DIR"

if [ -n "${CHAOS_BIN:-}" ]; then
  BIN="$CHAOS_BIN"   # an idemq built with --features failpoints already
else
  cargo build -p idemq-cli --features failpoints || exit 1
  BIN="${CARGO_TARGET_DIR:-target}/debug/idemq"
fi

# Kafka's consumers ask for a 2 s session (heartbeats every 400 ms; the
# broker of scripts/kafka.sh allows sessions from 1 s): each of a cell's
# ~40 kills leaves a dead member that the group waits out before it
# rebalances, and a 6 s session made the Kafka cells 126 s each where 2 s
# makes them about 50-90 s. The kills, the messages and the checks are the same.
source_url() {
  case "$1" in
    jsonl) echo "$DIR/orders-{run}.jsonl" ;;
    kafka) echo "kafka://127.0.0.1:9092/chaos_{run}?group=chaos_{run}&create_partitions=3&session_timeout_ms=2000&heartbeat.interval.ms=400" ;;
    amqp) echo "amqp://guest:guest@127.0.0.1:5672/%2f?queue=chaos_{run}" ;;
    sqs) echo "sqs://chaos_{run}?endpoint=http://127.0.0.1:5000&region=us-east-1&create=true&wait=1&visibility=5" ;;
    nats) echo "nats://127.0.0.1:4222/chaos_{run}/chaos_{run}_c?subject=chaos_{run}.orders&create=true&ack_wait=5s&wait=1s" ;;
    redis-stream) echo "redis-stream://127.0.0.1:6379/chaos_{run}?group=chaos&claim_idle=3s" ;;
    mqtt) echo "mqtt://127.0.0.1:1883/\$share/chaos/chaos_{run}/orders?client_id=chaos_{run}" ;;
    rocketmq) echo "rocketmq://127.0.0.1:9876/chaos_{run}?group=chaos_{run}_g" ;;
    *) echo "chaos.sh: unknown source $1" >&2; return 1 ;;
  esac
}

# Per source: how long a worker waits without messages before it exits. It
# must cover a (loaded) broker's receive round trip and its rebalances.
source_args() {
  case "$1" in
    sqs) echo "--idle-exit 15s" ;;
    kafka) echo "--idle-exit 15s" ;;
    rocketmq) echo "--idle-exit 20s" ;;
    *) echo "--idle-exit 3s" ;;
  esac
}

# Per cell: the database or broker restarts of the short and full matrix
# (CHAOS_RESTARTS=0 turns them off): PostgreSQL under the JSON-lines cell,
# MariaDB under the RabbitMQ cell, NATS and RabbitMQ under their PostgreSQL
# cells, FerretDB (MongoDB) under the RabbitMQ cell. Redis is never restarted (it keeps nothing on disk here).
restart_args() {
  [ "${CHAOS_RESTARTS:-1}" = 1 ] || return 0
  case "$1" in
    jsonl:postgres) echo "--restart-db" "scripts/restart-service.sh postgres" ;;
    amqp:mysql) echo "--restart-db" "scripts/restart-service.sh mariadb" ;;
    nats:postgres) echo "--restart-broker" "scripts/restart-service.sh nats" ;;
    amqp:postgres) echo "--restart-broker" "scripts/restart-service.sh rabbitmq" ;;
    amqp:mongo) echo "--restart-db" "scripts/restart-service.sh ferretdb" ;;
  esac
}

# Per cell mode: the consume mode of its workers (per-message by default).
mode_args() {
  case "$1" in
    "") ;;
    batch) echo "--batch 20" ;;
    watermark) echo "--watermark" ;;
    concurrent) echo "--watermark --concurrent-records" ;;
    *) echo "chaos.sh: unknown mode $1" >&2; return 1 ;;
  esac
}

store_url() {
  case "$1" in
    sqlite) echo "sqlite://$DIR/chaos-${2:-0}.db" ;;
    postgres|postgres-part) echo "postgres://postgres@127.0.0.1:5432/test" ;;
    mysql|mysql-part) echo "mysql://root@127.0.0.1:3306/test" ;;
    redis) echo "redis://127.0.0.1:6379" ;;
    mongo) echo "mongodb://127.0.0.1:27017/idemq_chaos" ;;
    *) echo "chaos.sh: unknown store $1" >&2; return 1 ;;
  esac
}

# The time-partitioned PostgreSQL and MariaDB inboxes, with two-second
# partitions so that kills and duplicates land on both sides of partition
# boundaries.
store_args() {
  case "$1" in
    postgres-part|mysql-part) echo "--partitioned-inbox 2s" ;;
  esac
}

SOURCES="jsonl kafka amqp sqs nats redis-stream mqtt rocketmq"
STORES="sqlite postgres postgres-part mysql mysql-part redis mongo"
if [ -z "$cells" ]; then
  if [ "$mode" = full ]; then
    for st in $STORES; do for so in $SOURCES; do cells="$cells $so:$st"; done; done
    for st in sqlite postgres postgres-part mysql mysql-part; do
      cells="$cells jsonl:$st:batch amqp:$st:batch kafka:$st:watermark kafka:$st:concurrent"
    done
    cells="$cells jsonl:redis:batch amqp:redis:batch jsonl:mongo:batch amqp:mongo:batch"
  else
    for so in $SOURCES; do cells="$cells $so:postgres"; done
    for st in sqlite mysql redis mongo postgres-part mysql-part; do cells="$cells jsonl:$st amqp:$st"; done
    cells="$cells jsonl:postgres:batch amqp:postgres:batch kafka:postgres:watermark"
    cells="$cells kafka:mysql:concurrent jsonl:redis:batch"
  fi
fi

echo "chaos: cells:$cells"
echo "chaos: $MESSAGES orders, $WORKERS workers, $KILLS random kills per cell, up to $PARALLEL cells at once; work dir $DIR"
: >"$REPORT"

# run_cell N CELL: runs one cell into $DIR/cell-N.{out,report}; its exit
# status is the cell's (4: the verdict failed; other non-zero: could not run).
run_cell() {
  local n="$1" cell="$2" so st cell_mode src store modeflags msgs workers flag cmd
  IFS=: read -r so st cell_mode <<<"$cell"
  src=$(source_url "$so") || return 2
  store=$(store_url "$st" "$n") || return 2
  modeflags=$(mode_args "${cell_mode:-}") || return 2
  msgs="$MESSAGES"
  workers="$WORKERS"
  if [ "$so" = sqs ]; then msgs="${CHAOS_SQS_MESSAGES:-300}"; fi
  if [ "$so" = mqtt ]; then msgs="${CHAOS_MQTT_MESSAGES:-3000}"; workers=2; fi
  local restart=()
  if [ -n "$(restart_args "$cell")" ]; then
    read -r flag cmd <<<"$(restart_args "$cell")"
    restart=("$flag" "$cmd")
  fi
  # shellcheck disable=SC2086
  "$BIN" --store "$store" chaos --source "$src" --messages "$msgs" \
    --kills "$KILLS" --workers "$workers" --work-dir "$DIR" --report "$DIR/cell-$n.report" \
    $(source_args "$so") $(store_args "$st") $modeflags "${restart[@]}" ${CHAOS_ARGS:-}
}

# finish N CELL CODE SECONDS: prints a finished cell's output and verdict.
finish() {
  local n="$1" cell="$2" code="$3" took="$4" so st cell_mode
  IFS=: read -r so st cell_mode <<<"$cell"
  cat "$DIR/cell-$n.out"
  echo "chaos: cell $so × $st${cell_mode:+ ($cell_mode)}: exit $code in $took s"
  finished=$((finished + 1))
  if [ "$code" -ne 0 ]; then
    failed=1
    if [ "$code" -ne 4 ]; then
      # Not a verdict: the cell could not run. Record it in the table.
      echo "| $so${cell_mode:+/$cell_mode} | $st | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | ERROR (exit $code) |" >"$DIR/cell-$n.report"
    fi
  fi
}

# Cells run up to $PARALLEL at once, each with its own SQLite file, topics,
# queues, tables and metrics ports; a cell that restarts a database or
# broker runs alone (the restart would hit the others' workers too).
failed=0
started=$(date +%s)
declare -A pid_cell=() pid_n=() pid_t0=()
finished=0
n=0
reap_one() {
  local pid code
  wait -n -p pid "${!pid_cell[@]}"
  code=$?
  finish "${pid_n[$pid]}" "${pid_cell[$pid]}" "$code" $(( $(date +%s) - ${pid_t0[$pid]} ))
  unset "pid_cell[$pid]" "pid_n[$pid]" "pid_t0[$pid]"
}
# The cells that restart a service first, one at a time; then the others,
# $PARALLEL at once. Cell numbers (their output files, the table's order)
# follow the list above.
i=0
for cell in $cells; do
  i=$((i + 1))
  [ -n "$(restart_args "$cell")" ] || continue
  t0=$(date +%s)
  run_cell "$i" "$cell" >"$DIR/cell-$i.out" 2>&1
  finish "$i" "$cell" $? $(( $(date +%s) - t0 ))
done
for cell in $cells; do
  n=$((n + 1))
  [ -z "$(restart_args "$cell")" ] || continue
  while [ "${#pid_cell[@]}" -ge "$PARALLEL" ]; do
    reap_one
  done
  run_cell "$n" "$cell" >"$DIR/cell-$n.out" 2>&1 &
  pid_cell[$!]="$cell"
  pid_n[$!]="$n"
  pid_t0[$!]="$(date +%s)"
done
while [ "${#pid_cell[@]}" -gt 0 ]; do
  reap_one
done
# Every cell must have ended with a verdict line above; a script error
# that skipped one fails the matrix.
if [ "$finished" -ne "$n" ]; then
  echo "chaos: only $finished of $n cells ran" >&2
  failed=1
fi
# One table, in the order of the cells.
header=""
for i in $(seq 1 "$n"); do
  f="$DIR/cell-$i.report"
  [ -s "$f" ] || continue
  if [ -z "$header" ]; then
    echo "| source | store | messages | dup same id | dup new id | poison | kills random | after_claim | after_handler | before_commit | after_commit_before_ack | restarts | db/broker restarts | double effects | lost | dead letters | seconds | result |" >>"$REPORT"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" >>"$REPORT"
    header=1
  fi
  grep -v '^| source \|^|---' "$f" >>"$REPORT"
done
echo
echo "chaos: $(( $(date +%s) - started )) s in all"
cat "$REPORT"
exit $failed
