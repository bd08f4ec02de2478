#!/usr/bin/env bash
# Stop what scripts/airflow.sh started: each component's whole process group (its children included),
# TERM first, KILL after a grace period. Safe to run again, or when nothing runs.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$root/.airflow}"
run="$AIRFLOW_HOME/run"
grace="${KB_AIRFLOW_STOP_GRACE:-30}"

group_alive() { kill -0 -- "-$1" 2> /dev/null; }

groups=()
for pidfile in "$run"/*.pid; do
  [ -f "$pidfile" ] || continue
  pid="$(cat "$pidfile")"
  rm -f "$pidfile"
  [[ "$pid" =~ ^[0-9]+$ ]] && group_alive "$pid" || continue
  # a stale pid file must not stop someone else's process that reused the pid: the leader is ours (airflow)
  # or gone, leaving only its children in the group
  if [ -e "/proc/$pid" ] && ! grep -qa airflow "/proc/$pid/cmdline" 2> /dev/null; then
    continue
  fi
  kill -TERM -- "-$pid" 2> /dev/null && groups+=("$pid") && echo "stopping airflow $(basename "$pidfile" .pid) (pid $pid)"
done
[ "${#groups[@]}" -gt 0 ] || { echo "no Airflow started from $AIRFLOW_HOME is running"; exit 0; }

for _ in $(seq 1 "$grace"); do
  left=0
  for pid in "${groups[@]}"; do group_alive "$pid" && left=1; done
  [ "$left" = 0 ] && break
  sleep 1
done
for pid in "${groups[@]}"; do
  if group_alive "$pid"; then
    echo "process group $pid ignored TERM for ${grace}s; killing it"
    kill -KILL -- "-$pid" 2> /dev/null
  fi
done
echo "stopped"
exit 0
