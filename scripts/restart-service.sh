#!/usr/bin/env bash
# Restarts one of the test services started by scripts/services.sh: stops it
# (gracefully, then by force), and services.sh starts it again and waits
# until it answers. For `idemq chaos --restart-db` / `--restart-broker` (see
# scripts/chaos.sh).
#
#   scripts/restart-service.sh postgres|mariadb|nats|rabbitmq|mosquitto|ferretdb
#
# FerretDB (scripts/ferretdb.sh) keeps its data in PostgreSQL, so a restart
# loses nothing.
#
# Redis is not offered: it keeps nothing on disk here, so a restart would
# lose a Redis store's records (and with them the proof).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh
case "${1:-}" in
  postgres) stop_pid "$IDEMQ_TOOLS/postgres/postgres.pid" INT ;; # fast shutdown
  mariadb) stop_pid "$IDEMQ_TOOLS/mariadb/mariadb.pid" TERM 120 ;;
  nats) stop_pid "$IDEMQ_TOOLS/nats/nats.pid" TERM ;;
  mosquitto) stop_pid "$IDEMQ_TOOLS/mosquitto/mosquitto.pid" TERM ;;
  rabbitmq)
    rabbitmqctl stop >/dev/null 2>&1 || true
    stop_pid "$IDEMQ_TOOLS/rabbitmq/rabbitmq.pid" TERM ;;
  ferretdb) stop_pid "$IDEMQ_TOOLS/ferretdb/ferretdb.pid" TERM ;;
  *)
    echo "restart-service.sh: usage: $0 postgres|mariadb|nats|rabbitmq|mosquitto|ferretdb" >&2
    exit 2 ;;
esac
echo "restart-service: $1 stopped; starting it again"
if [ "$1" = ferretdb ]; then
  scripts/ferretdb.sh >/dev/null
else
  scripts/services.sh "$1" >/dev/null
fi
echo "restart-service: $1 answers again"
