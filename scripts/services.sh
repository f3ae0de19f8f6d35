#!/usr/bin/env bash
# Makes sure the databases the tests use answer on 127.0.0.1, starting them
# with this machine's documented commands if they do not, and creates the
# `test` databases. Idempotent.
set -euo pipefail

wait_for() { # name, check command...
  local name=$1; shift
  for _ in $(seq 1 60); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "services: $name does not answer" >&2
  return 1
}

if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
  echo "services: starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
wait_for PostgreSQL pg_isready -h 127.0.0.1 -p 5432
if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1; then
  psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >/dev/null
fi

if ! mariadb -h 127.0.0.1 -uroot -e 'SELECT 1' >/dev/null 2>&1; then
  echo "services: starting MariaDB"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
fi
wait_for MariaDB mariadb -h 127.0.0.1 -uroot -e 'SELECT 1'
mariadb -h 127.0.0.1 -uroot -e 'CREATE DATABASE IF NOT EXISTS test'

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "services: starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi
wait_for Redis redis-cli -h 127.0.0.1 -p 6379 ping

if ! (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
  echo "services: starting RabbitMQ"
  rabbitmq-server -detached || true
fi
wait_for RabbitMQ bash -c 'exec 3<>/dev/tcp/127.0.0.1/5672'

if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
  echo "services: starting NATS (JetStream)"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log || true
fi
wait_for NATS bash -c 'exec 3<>/dev/tcp/127.0.0.1/4222'

if ! (exec 3<>/dev/tcp/127.0.0.1/1883) 2>/dev/null; then
  echo "services: starting Mosquitto"
  mosquitto -d -c /etc/mosquitto/mosquitto.conf || true
fi
wait_for Mosquitto bash -c 'exec 3<>/dev/tcp/127.0.0.1/1883'
