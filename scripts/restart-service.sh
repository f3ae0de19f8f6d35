#!/usr/bin/env bash
# Restarts one of the machine's services (stop, then scripts/services.sh
# starts it again and waits until it answers): for `idemq chaos
# --restart-db` / `--restart-broker` (see scripts/chaos.sh).
#
#   scripts/restart-service.sh postgres|mariadb|nats|rabbitmq
#
# Redis is not offered: it keeps nothing on disk here, so a restart would
# lose a Redis store's records (and with them the proof).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  postgres)
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main stop -m fast ;;
  mariadb)
    # `shutdown` returns before the server is gone: wait for the process,
    # or services.sh would still see it answer and not start it again.
    mariadb-admin -h 127.0.0.1 -uroot shutdown
    for _ in $(seq 1 120); do
      pgrep -x mariadbd >/dev/null || break
      sleep 0.5
    done ;;
  nats)
    start-stop-daemon --stop --oknodo --retry 10 --exec /usr/sbin/nats-server ;;
  rabbitmq)
    rabbitmqctl stop >/dev/null ;;
  *)
    echo "restart-service.sh: usage: $0 postgres|mariadb|nats|rabbitmq" >&2
    exit 2 ;;
esac
echo "restart-service: $1 stopped; starting it again"
scripts/services.sh >/dev/null
echo "restart-service: $1 answers again"
