# Sourced by airflow.sh and airflow-stop.sh: what they both ask of a component's process.

# runs: neither gone nor a zombie (a component killed with kill -9 stays a zombie while nobody reaps it, which
# in a container whose init does not reap orphans is forever: kill -0 would still answer for it)
running() { local stat; stat="$(ps -o stat= -p "$1" 2> /dev/null)" && [[ "$stat" != Z* ]]; }
# the kernel's start time of a process (clock ticks since boot, /proc/<pid>/stat field 22): with its pid it names
# one process whatever the wall clock did since (airflow.sh records it, airflow-stop.sh compares it)
start_ticks() { local s f; s="$(cat "/proc/$1/stat" 2> /dev/null)" || return 1; read -r -a f <<< "${s##*) }"; echo "${f[19]}"; }
