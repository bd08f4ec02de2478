#!/usr/bin/env bash
# Stop what scripts/airflow.sh started (Celery workers included): each component's whole session (setsid), so
# its children too, even those in process groups of their own (Airflow runs each task in its own group):
# TERM to the component first, KILL to whatever of its session is left after a grace period
# (KB_AIRFLOW_STOP_GRACE, 15 s). A session whose leader is already gone or a zombie (a component killed with
# kill -9) holds only orphans nobody will stop: KILLed at once. Zombies are not waited for. Safe to run again,
# or when nothing runs.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$root/.airflow}"
run="$AIRFLOW_HOME/run"
grace="${KB_AIRFLOW_STOP_GRACE:-15}"

source "$root/scripts/processes.sh"  # running, start_ticks
# the processes of a session that still run
members() { ps -e -o pid=,sid=,stat= | awk -v s="$1" '$2 == s && $3 !~ /^Z/ {print $1}'; }
# KILL lands at once, but a killed process takes a moment to end: wait (up to 5 s) until none of the session runs,
# so what starts next finds its ports and files free
gone() { local i; for i in $(seq 25); do [ -z "$(members "$1")" ] && return 0; sleep 0.2; done; return 1; }
kill_session() {
  local pids; pids="$(members "$1")"
  [ -z "$pids" ] && return 0
  kill -KILL $pids 2> /dev/null
  gone "$1" || echo "airflow: processes of session $1 still run 5 s after KILL: $(members "$1" | tr '\n' ' ')" >&2
}

# A stale pid file must not stop someone else's process that reused the pid: ours leads its own session and has
# the kernel start time airflow.sh recorded beside its pid file ($name.start; clock ticks since boot, so a wall
# clock stepped meanwhile changes nothing). Without that record (an older start, no /proc): older than its pid
# file, written just after it started (1 s for the clocks' rounding), which a wall clock stepped forward since
# defeats. Its command line and environment are no proof: a Celery worker retitles itself "[celeryd: ...]".
ours() {
  local sid age written recorded
  sid="$(ps -o sid= -p "$1" | tr -d ' ')" && [ "$sid" = "$1" ] || return 1
  if recorded="$(cat "$3" 2> /dev/null)" && [ -n "$recorded" ]; then
    [ "$(start_ticks "$1")" = "$recorded" ]
    return
  fi
  age="$(ps -o etimes= -p "$1" | tr -d ' ')" && written="$(stat -c %Y "$2")" \
    && [ "$age" -ge $(( $(date +%s) - written - 1 )) ]
}

trap 'rm -f "$run"/*.pid.stopping "$run"/*.start' EXIT
sessions=()
for pidfile in "$run"/*.pid; do
  [ -f "$pidfile" ] || continue
  pid="$(cat "$pidfile")"
  name="$(basename "$pidfile" .pid)"
  mv -f "$pidfile" "$pidfile.stopping"  # read by `ours`, removed on exit
  [[ "$pid" =~ ^[0-9]+$ ]] && [ -n "$(members "$pid")" ] || continue
  if ! running "$pid"; then
    kill_session "$pid"
    echo "airflow $name (pid $pid) was gone; killed what it left behind"
    continue
  fi
  ours "$pid" "$pidfile.stopping" "$run/$name.start" || continue
  kill -TERM -- "-$pid" 2> /dev/null && sessions+=("$pid") && echo "stopping airflow $name (pid $pid)"
done
[ "${#sessions[@]}" -gt 0 ] || { echo "no Airflow started from $AIRFLOW_HOME is running"; exit 0; }

deadline=$((SECONDS + grace))
while [ "$SECONDS" -lt "$deadline" ]; do
  left=0
  for pid in "${sessions[@]}"; do running "$pid" && left=1; done
  [ "$left" = 0 ] && break
  sleep 0.2
done
for pid in "${sessions[@]}"; do
  if running "$pid"; then
    echo "airflow (pid $pid) ignored TERM for ${grace}s; killing it"
  fi
  kill_session "$pid"  # the component, or what it left behind when it ended
done
echo "stopped"
exit 0
