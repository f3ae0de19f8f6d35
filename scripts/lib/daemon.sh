# Shared helpers for the scripts that start the test services (sourced, not
# run). Every service runs in the foreground of its own session (setsid), the
# way a container runs it, so no service manager is needed; its pid file holds
# "PID START" where START is the process's start time in clock ticks since
# boot, so a pid left by a process that died with an earlier session or CI
# run, and since reused by any other process, is never taken for the service.

IDEMQ_TOOLS="${IDEMQ_TOOLS:-$HOME/.idemq-tools}"
export IDEMQ_TOOLS

# True when something accepts TCP connections on HOST PORT.
port_open() {
  (exec 3<>"/dev/tcp/$1/$2") >/dev/null 2>&1
}

# The start time of process PID (field 22 of /proc/PID/stat), or nothing.
proc_start_time() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  # The command name (field 2) may hold spaces: count fields after its ')'.
  stat="${stat##*) }"
  # shellcheck disable=SC2086
  set -- $stat
  echo "${20}"
}

# True when PIDFILE names a live process that is the one that wrote it.
pid_alive() {
  local pid start now
  [ -f "$1" ] || return 1
  read -r pid start <"$1" || return 1
  [ -n "$pid" ] && [ -n "$start" ] || return 1
  now="$(proc_start_time "$pid")" || return 1
  [ "$now" = "$start" ] || return 1
  # Exited and not reaped yet (a zombie) is not alive.
  local stat
  stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [ "${stat%% *}" != Z ]
}

# The pid in PIDFILE when it is alive, else nothing (status 1).
live_pid() {
  pid_alive "$1" || return 1
  cut -d' ' -f1 "$1"
}

# spawn PIDFILE LOG COMMAND...: runs COMMAND in the background in a session
# of its own, output to LOG (the previous log is kept as LOG.prev), and
# writes PIDFILE.
spawn() {
  local pidfile="$1" log="$2" pid
  shift 2
  mkdir -p "$(dirname "$pidfile")" "$(dirname "$log")"
  [ -f "$log" ] && mv -f "$log" "$log.prev"
  setsid nohup "$@" >"$log" 2>&1 </dev/null &
  pid=$!
  echo "$pid $(proc_start_time "$pid")" >"$pidfile"
}

# spawn_unless_alive NAME PIDFILE LOG COMMAND...: spawns COMMAND (see spawn)
# unless the process in PIDFILE is alive (then it is still starting).
spawn_unless_alive() {
  local name="$1" pidfile="$2" log="$3"
  shift 3
  if pid_alive "$pidfile"; then
    echo "$name (pid $(live_pid "$pidfile")) is starting; waiting for it"
  else
    echo "starting $name (log $log)"
    spawn "$pidfile" "$log" "$@"
  fi
}

# stop_pid PIDFILE [SIGNAL] [SECONDS]: signals the process in PIDFILE (TERM by
# default) and waits until it is gone (then KILL), if it is alive.
stop_pid() {
  local pidfile="$1" sig="${2:-TERM}" secs="${3:-60}" pid
  pid="$(live_pid "$pidfile")" || { rm -f "$pidfile"; return 0; }
  kill "-$sig" "$pid" 2>/dev/null || true
  for _ in $(seq 1 $((secs * 2))); do
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    sleep 0.5
  done
  echo "$(basename "$pidfile" .pid): still running after ${secs} s; killing it" >&2
  kill -KILL "$pid" 2>/dev/null || true
  sleep 1
  rm -f "$pidfile"
}

# show_log NAME LOG...: the last lines of each LOG, on stderr.
show_log() {
  local name="$1" log
  shift
  for log in "$@"; do
    echo "--- $name: the end of $log:" >&2
    tail -n 30 "$log" >&2 2>/dev/null || echo "(no log)" >&2
  done
}

# wait_until NAME SECONDS PIDFILE LOG CHECK...: waits until CHECK succeeds.
# Fails early when PIDFILE is given (not "-") and its process died; on
# failure prints the end of LOG and says which service failed and why.
wait_until() {
  local name="$1" secs="$2" pidfile="$3" log="$4" deadline
  shift 4
  deadline=$((SECONDS + secs))
  while [ "$SECONDS" -lt "$deadline" ]; do
    if "$@" >/dev/null 2>&1; then
      return 0
    fi
    if [ "$pidfile" != - ] && ! pid_alive "$pidfile"; then
      show_log "$name" "$log"
      echo "services: $name exited during start-up (log: $log)" >&2
      return 1
    fi
    sleep 0.5
  done
  show_log "$name" "$log"
  echo "services: $name did not answer within ${secs} s (log: $log)" >&2
  return 1
}

# Debian's packages, installed once: apt-get runs only for what is missing.
# policy-rc.d keeps the packages' maintainer scripts from starting services
# (there is no service manager; the scripts start them).
apt_install() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  echo "services: installing ${missing[*]} from Debian's packages"
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    made_policy=1
  fi
  local status=0
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >/tmp/idemq-apt.log 2>&1 ||
    { $sudo apt-get update -q >>/tmp/idemq-apt.log 2>&1 &&
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >>/tmp/idemq-apt.log 2>&1; } ||
    status=$?
  [ "$made_policy" = 1 ] && $sudo rm -f "$policy"
  if [ "$status" != 0 ]; then
    tail -n 30 /tmp/idemq-apt.log >&2
    echo "services: apt-get install ${missing[*]} failed (log: /tmp/idemq-apt.log)" >&2
    return 1
  fi
}
