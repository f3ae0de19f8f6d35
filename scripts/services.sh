#!/usr/bin/env bash
# Installs (once, from Debian's packages) and starts (every time; a service
# that already answers is left alone) the services the tests use, each bound
# to 127.0.0.1 and run in the foreground of its own session the way a
# container runs it (no service manager needed):
#
#   postgres   PostgreSQL :5432, trust for `postgres`, database `test`, TLS on
#              with a local certificate ($IDEMQ_TOOLS/postgres/root.crt)
#   mariadb    MariaDB    :3306, `root` with an empty password, database `test`,
#              TLS on with a local certificate ($IDEMQ_TOOLS/mariadb/root.crt)
#   redis      Redis      :6379, nothing kept on disk; TLS on :6380 with a
#              local certificate ($IDEMQ_TOOLS/redis/root.crt)
#   rabbitmq   RabbitMQ   :5672, guest/guest; TLS on :5671 with a local
#              certificate ($IDEMQ_TOOLS/rabbitmq/root.crt); the management
#              HTTP API on :15672 (the source reads queue policies there)
#   mosquitto  Mosquitto  :1883, anonymous; a local certificate for the TLS
#              brokers the tests start ($IDEMQ_TOOLS/mosquitto/root.crt)
#   nats       NATS       :4222 with JetStream; a local certificate for the
#              TLS servers the tests start ($IDEMQ_TOOLS/nats/root.crt)
#
#   scripts/services.sh                 # all of them
#   scripts/services.sh postgres nats   # some of them
#
# State and logs live under ${IDEMQ_TOOLS:-$HOME/.idemq-tools}/<service>
# (PostgreSQL's and MariaDB's data under /var/lib). Waits until each answers;
# on failure prints the end of that service's log and names it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/daemon.sh
. scripts/lib/daemon.sh
# shellcheck source=scripts/lib/tls.sh
. scripts/lib/tls.sh

ALL="postgres mariadb redis rabbitmq mosquitto nats"
WANTED="${*:-$ALL}"
for s in $WANTED; do
  case " $ALL " in *" $s "*) ;; *) echo "services.sh: unknown service $s (known: $ALL)" >&2; exit 2 ;; esac
done
wanted() { case " $WANTED " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# as_user USER COMMAND...: runs COMMAND as USER, without a fork in between
# (so a pid file names the service itself).
as_user() {
  local user="$1"
  shift
  setpriv --reuid="$user" --regid="$user" --init-groups "$@"
}
AS_POSTGRES=(setpriv --reuid=postgres --regid=postgres --init-groups)
AS_RABBITMQ=(setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups)

# ---- PostgreSQL -----------------------------------------------------------
PG_RUN="$IDEMQ_TOOLS/postgres"
PG_DATA=/var/lib/postgresql/idemq/data
PG_TLS=/var/lib/postgresql/idemq/tls
PG_PID="$PG_RUN/postgres.pid"
PG_LOG="$PG_RUN/postgres.log"
pg_bin() { ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1; }
pg_answers() { pg_isready -q -h 127.0.0.1 -p 5432; }
start_postgres() {
  pg_answers >/dev/null 2>&1 && return 0
  local bin
  bin="$(pg_bin)"
  mkdir -p "$PG_RUN"
  install -d -o postgres -g postgres /var/run/postgresql
  if [ ! -f "$PG_DATA/PG_VERSION" ]; then
    echo "services: creating the PostgreSQL cluster in $PG_DATA"
    install -d -o postgres -g postgres -m 700 "$PG_DATA"
    as_user postgres "$bin/initdb" -D "$PG_DATA" -U postgres --auth=trust --encoding=UTF8 \
      --locale=C.UTF-8 >"$PG_RUN/initdb.log" 2>&1 ||
      { show_log PostgreSQL "$PG_RUN/initdb.log"; echo "services: PostgreSQL initdb failed" >&2; return 1; }
    cat >>"$PG_DATA/postgresql.conf" <<CONF
# idemq test service (scripts/services.sh)
listen_addresses = '127.0.0.1'
port = 5432
max_connections = 200
unix_socket_directories = '/var/run/postgresql'
ssl = on
CONF
  fi
  # TLS on loopback (sslmode=require; a client that verifies uses
  # $PG_RUN/root.crt, the CA that signed the server's certificate).
  tls_cert "$PG_TLS" postgres || return 1
  cp -f "$PG_TLS/ca.crt" "$PG_RUN/root.crt"
  if ! pid_alive "$PG_PID"; then
    # Nothing of ours runs: a lock file left by a server killed with an
    # earlier session is stale (its pid may now belong to anything).
    rm -f "$PG_DATA/postmaster.pid"
    echo "services: starting PostgreSQL (log $PG_LOG)"
    spawn "$PG_PID" "$PG_LOG" "${AS_POSTGRES[@]}" "$bin/postgres" -D "$PG_DATA" \
      -c ssl=on -c ssl_cert_file="$PG_TLS/server.crt" -c ssl_key_file="$PG_TLS/server.key"
  fi
}
ready_postgres() {
  wait_until PostgreSQL 60 "$PG_PID" "$PG_LOG" pg_answers || return 1
  if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1; then
    psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE test"
  fi
  tls_client_cert "$PG_TLS" postgres "$PG_RUN" || return 1
  # Role idemq-client logs in only over TLS with a client certificate of the
  # local CA whose CN is its name (tests/integration/tls.rs); first in pg_hba.conf.
  if ! grep -q '^# idemq client certificate' "$PG_DATA/pg_hba.conf"; then
    local hba
    hba="$(cat "$PG_DATA/pg_hba.conf")"
    printf '# idemq client certificate (scripts/services.sh)\nhostssl all idemq-client 127.0.0.1/32 cert\nhost all idemq-client 127.0.0.1/32 reject\n%s\n' \
      "$hba" >"$PG_DATA/pg_hba.conf"
  fi
  # Client certificates are verified against the local CA; the role they log in as.
  psql -h 127.0.0.1 -U postgres -d test -q >/dev/null <<SQL
ALTER SYSTEM SET ssl_ca_file = '$PG_TLS/ca.crt';
SELECT pg_reload_conf();
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'idemq-client') THEN
    CREATE ROLE "idemq-client" LOGIN;
  END IF;
END \$\$;
GRANT ALL ON DATABASE test TO "idemq-client";
GRANT ALL ON SCHEMA public TO "idemq-client";
SQL
}

# ---- MariaDB --------------------------------------------------------------
MY_RUN="$IDEMQ_TOOLS/mariadb"
MY_PID="$MY_RUN/mariadb.pid"
MY_LOG="$MY_RUN/mariadb.log"
MY_TLS=/var/lib/idemq-mariadb-tls
my_answers() { mariadb -h 127.0.0.1 -P 3306 -uroot -e 'SELECT 1'; }
my_socket_answers() { mariadb --protocol=socket -S /run/mysqld/mysqld.sock -uroot -e 'SELECT 1'; }
start_mariadb() {
  my_answers >/dev/null 2>&1 && return 0
  mkdir -p "$MY_RUN"
  install -d -o mysql -g mysql /run/mysqld
  if [ ! -d /var/lib/mysql/mysql ]; then
    echo "services: creating MariaDB's system tables in /var/lib/mysql"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$MY_RUN/install-db.log" 2>&1 ||
      { show_log MariaDB "$MY_RUN/install-db.log"; echo "services: mariadb-install-db failed" >&2; return 1; }
  fi
  # TLS on loopback (ssl-mode=REQUIRED; a client that verifies uses
  # $MY_RUN/root.crt). The key lives where the mysql user can read it.
  tls_cert "$MY_TLS" mysql || return 1
  cp -f "$MY_TLS/ca.crt" "$MY_RUN/root.crt"
  spawn_unless_alive "services: MariaDB" "$MY_PID" "$MY_LOG" /usr/sbin/mariadbd --user=mysql \
    --datadir=/var/lib/mysql --bind-address=127.0.0.1 --port=3306 \
    --ssl-cert="$MY_TLS/server.crt" --ssl-key="$MY_TLS/server.key" --ssl-ca="$MY_TLS/ca.crt" \
    --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid --log-error="$MY_RUN/error.log"
}
ready_mariadb() {
  wait_until MariaDB 90 "$MY_PID" "$MY_RUN/error.log" my_socket_answers || return 1
  tls_client_cert "$MY_TLS" mysql "$MY_RUN" || return 1
  # Debian's root logs in by unix socket only; the tests log in over TCP as
  # root with an empty password (loopback only), with clients (sqlx) that do
  # not follow an authentication chain: plain mysql_native_password.
  mariadb --protocol=socket -S /run/mysqld/mysqld.sock -uroot <<'SQL'
ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD('');
CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
CREATE USER IF NOT EXISTS 'root'@'::1' IDENTIFIED BY '';
GRANT ALL PRIVILEGES ON *.* TO 'root'@'::1' WITH GRANT OPTION;
-- Logs in only with a client certificate of the local CA (tests/integration/tls.rs).
CREATE USER IF NOT EXISTS 'idemq-client'@'127.0.0.1' REQUIRE SUBJECT '/CN=idemq-client';
GRANT ALL PRIVILEGES ON test.* TO 'idemq-client'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL
  wait_until MariaDB 30 "$MY_PID" "$MY_RUN/error.log" my_answers || return 1
  # utf8mb4 whoever made it: mariadb-install-db makes a latin1 `test`, in
  # which the tests' own tables could not hold every key.
  mariadb -h 127.0.0.1 -uroot \
    -e 'CREATE DATABASE IF NOT EXISTS test; ALTER DATABASE test CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci'
}

# ---- Redis ----------------------------------------------------------------
RD_RUN="$IDEMQ_TOOLS/redis"
RD_PID="$RD_RUN/redis.pid"
RD_LOG="$RD_RUN/redis.log"
rd_answers() { redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG; }
start_redis() {
  rd_answers >/dev/null 2>&1 && return 0
  mkdir -p "$RD_RUN"
  # TLS on a second port, 6380 (rediss://; a client that verifies uses
  # $RD_RUN/root.crt); a client certificate is verified when one is shown
  # ($RD_RUN/client.{crt,key} is one), not required.
  tls_cert "$RD_RUN/tls" "$(id -un)" || return 1
  cp -f "$RD_RUN/tls/ca.crt" "$RD_RUN/root.crt"
  spawn_unless_alive "services: Redis" "$RD_PID" "$RD_LOG" redis-server --bind 127.0.0.1 -::1 \
    --port 6379 --save "" --appendonly no --dir "$RD_RUN" --daemonize no \
    --tls-port 6380 --tls-cert-file "$RD_RUN/tls/server.crt" --tls-key-file "$RD_RUN/tls/server.key" \
    --tls-ca-cert-file "$RD_RUN/tls/ca.crt" --tls-auth-clients optional
}
ready_redis() {
  wait_until Redis 30 "$RD_PID" "$RD_LOG" rd_answers || return 1
  tls_client_cert "$RD_RUN/tls" "$(id -un)" "$RD_RUN"
}

# ---- RabbitMQ -------------------------------------------------------------
RB_RUN="$IDEMQ_TOOLS/rabbitmq"
RB_PID="$RB_RUN/rabbitmq.pid"
RB_LOG="$RB_RUN/rabbitmq.log"
RB_TLS=/var/lib/rabbitmq/idemq-tls
rb_answers() { port_open 127.0.0.1 5672; }
rb_tls_answers() { port_open 127.0.0.1 5671; }
rb_management_answers() { port_open 127.0.0.1 15672; }
start_rabbitmq() {
  mkdir -p "$RB_RUN"
  # TLS on 5671 (amqps://; a client that verifies uses $RB_RUN/root.crt); a
  # client certificate is verified when one is shown ($RB_RUN/client.{crt,key}
  # is one), not required.
  install -d -o rabbitmq -g rabbitmq /var/lib/rabbitmq
  tls_cert "$RB_TLS" rabbitmq || return 1
  tls_client_cert "$RB_TLS" rabbitmq "$RB_RUN" || return 1
  cp -f "$RB_TLS/ca.crt" "$RB_RUN/root.crt"
  local conf=/etc/rabbitmq/rabbitmq.conf
  mkdir -p /etc/rabbitmq
  local reconfigured=false
  # The management plugin: its HTTP API is where a queue's policies (and so
  # its effective max-length, message-ttl, delivery-limit) can be read.
  if ! grep -q 'rabbitmq_management' /etc/rabbitmq/enabled_plugins 2>/dev/null; then
    echo '[rabbitmq_management].' >/etc/rabbitmq/enabled_plugins
    reconfigured=true
  fi
  if ! grep -q '^# idemq test service v3' "$conf" 2>/dev/null; then
    cat >"$conf" <<CONF
# idemq test service v3 (scripts/services.sh)
management.tcp.ip = 127.0.0.1
management.tcp.port = 15672
listeners.ssl.default = 127.0.0.1:5671
ssl_options.cacertfile = $RB_TLS/ca.crt
ssl_options.certfile = $RB_TLS/server.crt
ssl_options.keyfile = $RB_TLS/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
CONF
    reconfigured=true
  fi
  if rb_answers >/dev/null 2>&1; then
    rb_tls_answers >/dev/null 2>&1 && [ "$reconfigured" = false ] && return 0
    # Started with an older configuration: restart it.
    echo "services: restarting RabbitMQ with its TLS and management configuration"
    rabbitmqctl stop >/dev/null 2>&1 || true
    local waited=0
    while { rb_answers >/dev/null 2>&1 || pid_alive "$RB_PID"; } && [ "$waited" -lt 60 ]; do
      sleep 1
      waited=$((waited + 1))
    done
  fi
  # One node name for the server and rabbitmqctl that needs no host name
  # lookup; loopback only (epmd too).
  local envconf=/etc/rabbitmq/rabbitmq-env.conf
  mkdir -p /etc/rabbitmq
  if ! grep -q '^# idemq test service v2' "$envconf" 2>/dev/null; then
    sed -i '/^# idemq test service/,$d' "$envconf" 2>/dev/null || true
    cat >>"$envconf" <<'CONF'
# idemq test service v2 (scripts/services.sh)
NODENAME=rabbit@localhost
NODE_IP_ADDRESS=127.0.0.1
SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
CONF
  fi
  spawn_unless_alive "services: RabbitMQ" "$RB_PID" "$RB_LOG" "${AS_RABBITMQ[@]}" \
    env HOME=/var/lib/rabbitmq ERL_EPMD_ADDRESS=127.0.0.1 \
    sh -c 'cd /var/lib/rabbitmq && exec /usr/lib/rabbitmq/bin/rabbitmq-server'
}
rb_both_answer() { rb_answers && rb_tls_answers && rb_management_answers; }
ready_rabbitmq() { wait_until RabbitMQ 120 "$RB_PID" "$RB_LOG" rb_both_answer; }

# ---- Mosquitto ------------------------------------------------------------
MQ_RUN="$IDEMQ_TOOLS/mosquitto"
MQ_PID="$MQ_RUN/mosquitto.pid"
MQ_LOG="$MQ_RUN/mosquitto.log"
mq_answers() { port_open 127.0.0.1 1883; }
start_mosquitto() {
  # A certificate for the TLS brokers the tests start themselves; a client
  # that verifies uses root.crt.
  tls_cert "$MQ_RUN/tls" "$(id -un)" || return 1
  tls_client_cert "$MQ_RUN/tls" "$(id -un)" "$MQ_RUN" || return 1
  cp -f "$MQ_RUN/tls/ca.crt" "$MQ_RUN/root.crt"
  mq_answers >/dev/null 2>&1 && return 0
  mkdir -p "$MQ_RUN"
  install -d -o mosquitto -g mosquitto /var/lib/mosquitto
  # Debian's defaults (persistence on), on loopback, except the per-client
  # queue: Mosquitto's default max_queued_messages 1000 DROPS QoS 1/2
  # messages for a subscriber that falls behind (its log says "Outgoing
  # messages are being dropped"); 0 is no limit (docs/operations.md, "Loss
  # the broker causes").
  cat >"$MQ_RUN/mosquitto.conf" <<CONF
# idemq test service (scripts/services.sh)
listener 1883 127.0.0.1
allow_anonymous true
user mosquitto
persistence true
persistence_location /var/lib/mosquitto/
max_queued_messages 0
max_queued_bytes 0
log_dest stdout
CONF
  spawn_unless_alive "services: Mosquitto" "$MQ_PID" "$MQ_LOG" mosquitto -c "$MQ_RUN/mosquitto.conf"
}
ready_mosquitto() { wait_until Mosquitto 30 "$MQ_PID" "$MQ_LOG" mq_answers; }

# ---- NATS -----------------------------------------------------------------
NT_RUN="$IDEMQ_TOOLS/nats"
NT_PID="$NT_RUN/nats.pid"
NT_LOG="$NT_RUN/nats.log"
nt_answers() { port_open 127.0.0.1 4222; }
start_nats() {
  # A certificate for the NATS servers the TLS tests start themselves (each
  # with its own authorization); a client that verifies uses root.crt.
  tls_cert "$NT_RUN/tls" "$(id -un)" || return 1
  tls_client_cert "$NT_RUN/tls" "$(id -un)" "$NT_RUN" || return 1
  cp -f "$NT_RUN/tls/ca.crt" "$NT_RUN/root.crt"
  nt_answers >/dev/null 2>&1 && return 0
  mkdir -p "$NT_RUN/jetstream"
  spawn_unless_alive "services: NATS with JetStream" "$NT_PID" "$NT_LOG" \
    nats-server -a 127.0.0.1 -p 4222 -js -sd "$NT_RUN/jetstream"
}
ready_nats() { wait_until NATS 30 "$NT_PID" "$NT_LOG" nt_answers; }

# ---- install, start all, then wait for each ---------------------------------
pkgs=()
wanted postgres && pkgs+=(postgresql openssl)
wanted mariadb && pkgs+=(mariadb-server mariadb-client openssl)
wanted redis && pkgs+=(redis-server redis-tools openssl)
wanted rabbitmq && pkgs+=(rabbitmq-server)
wanted mosquitto && pkgs+=(mosquitto)
wanted nats && pkgs+=(nats-server)
apt_install "${pkgs[@]}"

declare -A NAME=([postgres]=PostgreSQL [mariadb]=MariaDB [redis]=Redis [rabbitmq]=RabbitMQ [mosquitto]=Mosquitto [nats]=NATS)
failed=()
for s in $WANTED; do
  "start_$s" || failed+=("${NAME[$s]}")
done
for s in $WANTED; do
  case " ${failed[*]} " in *" ${NAME[$s]} "*) continue ;; esac
  "ready_$s" || failed+=("${NAME[$s]}")
done
if ((${#failed[@]})); then
  echo "services: FAILED: ${failed[*]} (see the log lines above)" >&2
  exit 1
fi
echo "services: ready: $WANTED"
