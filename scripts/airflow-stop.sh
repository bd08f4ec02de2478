#!/usr/bin/env bash
# Stop what scripts/airflow.sh started (Celery workers included): each component's whole process group (its
# children included), TERM first, KILL after a grace period (KB_AIRFLOW_STOP_GRACE, 15 s). A group whose
# leader is already gone or a zombie (a component killed with kill -9) holds only orphans nobody will stop:
# KILLed at once. Zombies are not waited for. Safe to run again, or when nothing runs.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$root/.airflow}"
run="$AIRFLOW_HOME/run"
grace="${KB_AIRFLOW_STOP_GRACE:-15}"

# a process runs unless gone or a zombie: a component killed with kill -9 stays a zombie while nobody reaps it
# (in a container whose init does not reap orphans, forever), and kill -0 answers for zombies too
running() { local stat; stat="$(ps -o stat= -p "$1" 2> /dev/null)" && [[ "$stat" != Z* ]]; }
group_alive() { ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'; }

groups=()
for pidfile in "$run"/*.pid; do
  [ -f "$pidfile" ] || continue
  pid="$(cat "$pidfile")"
  name="$(basename "$pidfile" .pid)"
  rm -f "$pidfile"
  [[ "$pid" =~ ^[0-9]+$ ]] && group_alive "$pid" || continue
  if ! running "$pid"; then
    kill -KILL -- "-$pid" 2> /dev/null && echo "airflow $name (pid $pid) was gone; killed what it left behind"
    continue
  fi
  # a stale pid file must not stop someone else's process that reused the pid: the leader is ours (airflow)
  grep -qa airflow "/proc/$pid/cmdline" 2> /dev/null || continue
  kill -TERM -- "-$pid" 2> /dev/null && groups+=("$pid") && echo "stopping airflow $name (pid $pid)"
done
[ "${#groups[@]}" -gt 0 ] || { echo "no Airflow started from $AIRFLOW_HOME is running"; exit 0; }

deadline=$((SECONDS + grace))
while [ "$SECONDS" -lt "$deadline" ]; do
  left=0
  for pid in "${groups[@]}"; do group_alive "$pid" && left=1; done
  [ "$left" = 0 ] && break
  sleep 0.2
done
for pid in "${groups[@]}"; do
  if group_alive "$pid"; then
    echo "process group $pid ignored TERM for ${grace}s; killing it"
    kill -KILL -- "-$pid" 2> /dev/null
  fi
done
echo "stopped"
exit 0
