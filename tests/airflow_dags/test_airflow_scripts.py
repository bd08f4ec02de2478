"""scripts/airflow.sh and scripts/airflow-stop.sh without starting Airflow: what they refuse, and how they
stop what a component killed with kill -9 left behind. (The real stacks: test_local_airflow.py and
test_celery_airflow.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

BIN = Path(sys.executable).parent


def script(name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "scripts" / name)], env=env, capture_output=True, text=True, timeout=120)


def base_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "KB_"))}
    env.update(AIRFLOW_HOME=str(home), PATH=f"{BIN}:{env.get('PATH', '')}", **extra)
    return env


@pytest.mark.parametrize("extra, message", [
    ({"KB_AIRFLOW_EXECUTOR": "CeleryExecutor"}, "CeleryExecutor needs a metadata DB every worker reaches, not SQLite"),
    ({"KB_AIRFLOW_EXECUTOR": "CeleryExecutor", "KB_AIRFLOW_DB_URL": "postgresql+psycopg2://u@h/airflow",
      "KB_CELERY_WORKERS": "two"}, "KB_CELERY_WORKERS must be a whole number >= 1, not 'two'"),
])
def test_celery_on_sqlite_or_a_bad_worker_count_is_refused_before_anything_starts(tmp_path: Path, extra: dict[str, str],
                                                                                  message: str) -> None:
    done = script("airflow.sh", base_env(tmp_path / "home", **extra))
    assert done.returncode == 1 and message in done.stderr, done.stdout + done.stderr
    assert not list((tmp_path / "home" / "run").glob("*.pid")), "nothing was started"


@pytest.mark.parametrize("extra, warned", [({"KB_ALIAS": "policy_wiki"}, True), ({"KB_KNOWLEDGE_DIR": "/srv/wiki"}, True),
                                           ({"KB_ALIAS": "policy_wiki", "KB_REGISTRY": ""}, False), ({}, False)])
def test_the_single_form_settings_without_kb_registry_are_said_to_be_ignored(tmp_path: Path, extra: dict[str, str],
                                                                             warned: bool) -> None:
    """`make airflow` serves the shipped registry unless KB_REGISTRY says otherwise: KB_ALIAS or KB_KNOWLEDGE_DIR set
    alone would be ignored, so it says so (here before its refusal of Celery on SQLite stops it)."""
    done = script("airflow.sh", base_env(tmp_path / "home", KB_AIRFLOW_EXECUTOR="CeleryExecutor", **extra))
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("KB_ALIAS/KB_KNOWLEDGE_DIR are set but KB_REGISTRY is not: serving the shipped registry" in done.stderr) \
        is warned, done.stderr


def test_stop_kills_at_once_what_a_component_killed_with_kill_9_left_behind(tmp_path: Path) -> None:
    """The scheduler killed with kill -9 stays a zombie (nobody reaps it) while a child of its session, in a
    process group of its own (as Airflow runs a task) and ignoring TERM, runs on: airflow-stop kills that group at once instead of skipping it (a zombie has no
    command line to recognise) or waiting out the grace period on it."""
    run = tmp_path / "home" / "run"
    run.mkdir(parents=True)
    leader = subprocess.Popen(["bash", "-c", "trap '' TERM; set -m; sleep 600 & echo started; wait"], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout is not None and leader.stdout.readline() == "started\n"  # its child runs
        (run / "scheduler.pid").write_text(str(leader.pid))
        os.kill(leader.pid, signal.SIGKILL)
        state = ""
        while state != "Z":  # the kill has landed: a zombie until this test reaps it
            state = Path(f"/proc/{leader.pid}/stat").read_text().split(") ", 1)[1][0]
        stopped = script("airflow-stop.sh", base_env(tmp_path / "home", KB_AIRFLOW_STOP_GRACE="600"))
        assert stopped.returncode == 0, stopped.stderr
        assert f"airflow scheduler (pid {leader.pid}) was gone; killed what it left behind" in stopped.stdout, stopped.stdout
        left = subprocess.run(["ps", "-e", "-o", "sid=,stat="], capture_output=True, text=True).stdout.split("\n")
        assert not [line for line in left if line.split()[:1] == [str(leader.pid)] and not line.split()[1].startswith("Z")]
        assert not list(run.glob("*.pid"))
    finally:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        leader.wait(timeout=30)


def test_stop_recognises_its_components_by_their_session_and_age_not_their_title(tmp_path: Path) -> None:
    """A Celery worker retitles itself ("[celeryd: ...]"), overwriting its command line and environment: a
    component is ours when it leads its session and is older than its pid file. A pid file older than the process
    it names (the pid was reused since) is left alone."""
    home = tmp_path / "home"
    (home / "run").mkdir(parents=True)
    ours = subprocess.Popen(["bash", "-c", "exec -a '[celeryd: kb-worker-1@host:MainProcess]' sleep 600"],
                            start_new_session=True, env={})
    theirs = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (home / "run" / "worker-1.pid").write_text(str(ours.pid))
        stale = home / "run" / "worker-2.pid"
        stale.write_text(str(theirs.pid))
        written = stale.stat().st_mtime - 600
        os.utime(stale, (written, written))  # written ten minutes before its process started: a reused pid
        stopped = script("airflow-stop.sh", base_env(home))
        assert f"stopping airflow worker-1 (pid {ours.pid})" in stopped.stdout, stopped.stdout
        assert ours.wait(timeout=30) == -signal.SIGTERM
        assert theirs.poll() is None, "a process that reused a stale pid file's pid was stopped"
        assert not list((home / "run").iterdir())
    finally:
        for process in (ours, theirs):
            process.kill()
            process.wait(timeout=30)


def start_ticks(pid: int) -> str:
    """/proc/<pid>/stat's start time (clock ticks since boot), as airflow.sh records it beside a pid file."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]


def test_stop_knows_its_components_by_their_kernel_start_time_whatever_the_wall_clock_did(tmp_path: Path) -> None:
    """The wall clock stepped forward ten minutes since the stack started (an NTP correction): its pid files now
    look older than their processes, as a reused pid's would. The start time airflow.sh recorded beside each
    (`<name>.start`) says which are still the processes it started: those are stopped; a process whose start
    time differs (the pid was reused) is left alone, whatever the pid file's age."""
    home = tmp_path / "home"
    run = home / "run"
    run.mkdir(parents=True)
    ours = subprocess.Popen(["sleep", "600"], start_new_session=True)
    theirs = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        for name, process, ticks in (("scheduler", ours, start_ticks(ours.pid)),
                                     ("triggerer", theirs, str(int(start_ticks(theirs.pid)) - 1000))):
            pid_file = run / f"{name}.pid"
            pid_file.write_text(str(process.pid))
            (run / f"{name}.start").write_text(ticks + "\n")
            stepped = pid_file.stat().st_mtime - 600
            os.utime(pid_file, (stepped, stepped))
        stopped = script("airflow-stop.sh", base_env(home))
        assert f"stopping airflow scheduler (pid {ours.pid})" in stopped.stdout, stopped.stdout
        assert ours.wait(timeout=30) == -signal.SIGTERM
        assert theirs.poll() is None, "a process that reused the pid of a pid file was stopped"
        assert not list(run.iterdir()), "pid files and start times removed"
    finally:
        for process in (ours, theirs):
            process.kill()
            process.wait(timeout=30)
