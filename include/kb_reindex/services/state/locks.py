"""Named locks in the state DB: the owner format (`[run_id@]host:pid:nonce:space`), whether an owner still
lives, takeover of a dead owner's lock, expiry after the TTL, on-call's unlock, and the heartbeat."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kb_reindex.domain.errors import LockHeldError
from kb_reindex.domain.waiting import Look, Sleeping, Waiter
from kb_reindex.services.state.dag_runs import dag_run_alive
from kb_reindex.services.state.schema import _first_line, lock_events, locks, runs

if TYPE_CHECKING:
    from kb_reindex.services.state.clock import Clock

log = logging.getLogger(__name__)


def process_space() -> str:
    """Which PID namespace of which boot this process lives in: two containers (or cloned VMs) can share a
    hostname while their PIDs mean different processes, so only an owner of this same space is judged by PID."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return "unknown"
    return hashlib.sha1(f"{boot}:{namespace}".encode()).hexdigest()[:10]


#: what follows the run id in a DAG run's lock owner (kb_reindex.run.dag_lock), in place of `host:pid:nonce:space`:
#: the run spans many task processes, so it is alive while Airflow runs it (`state.dag_runs`, where Airflow can
#: be asked) and its tasks renew the lock, not while a PID lives
DAG_RUN_OWNER = "airflow-dag-run"


def is_dag_run_owner(owner: str) -> bool:
    return owner.endswith(f"@{DAG_RUN_OWNER}")


def default_lock_owner(run_id: str | None = None, *, pid: int | None = None) -> str:
    """Unique per acquisition: two threads of one process are two owners. A run's own lock starts with
    its run id, so others can tell that run is still alive while its heartbeat renews the lock; the rest
    (`host:pid:nonce:space`) lets this host tell whether the owner process still lives."""
    owner = f"{socket.gethostname()}:{os.getpid() if pid is None else pid}:{uuid.uuid4().hex[:8]}:{process_space()}"
    return f"{run_id[:254 - len(owner)]}@{owner}" if run_id else owner


@dataclass(frozen=True)
class LockRecord:
    """One row of `kb_locks`. `expired` and `owner_alive` are judged when listed (`list_locks`): a holder
    returned by `_try_lock` / `break_lock` carries the defaults."""

    name: str
    owner: str
    acquired_at: datetime
    expires_at: datetime
    expired: bool = False
    owner_alive: bool | None = None

    @classmethod
    def from_row(cls, row: Any) -> LockRecord:
        return cls(name=row["name"], owner=row["owner"], acquired_at=row["acquired_at"], expires_at=row["expires_at"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LockEvent:
    """One row of `kb_lock_events`: a lock broken by on-call (`unlock`) or taken from a dead owner (`takeover`)."""

    id: int
    name: str
    action: str
    owner: str
    by: str
    reason: str | None
    at: datetime

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LocksMixin:
    """Lock rows of `StateStore`; expiry judged by its clock, waiting by real time."""

    engine: sa.Engine
    clock: Clock

    # --- locks ----------------------------------------------------------------------------------

    def acquire_lock(self, name: str, *, owner: str, ttl_s: float, wait_s: float = 0.0,
                     waiter: Waiter | None = None) -> None:
        """A lock row with owner and expiry: works the same on SQLite and MySQL, survives no crash forever.

        Taken over at once when its owner process is gone from this host (kill -9 leaves a row behind), after
        its TTL when held from another host; otherwise waited for up to `wait_s` (sleeping, unless `waiter`
        passes the time otherwise: a DAG task's gives its slot back), then refused by name."""

        def look() -> Look:
            holder = self._try_lock(name, owner=owner, ttl_s=ttl_s)
            return Look(True) if holder is None else Look(False, describe_lock_holder(name, holder))

        seen = (waiter or Sleeping()).until(look, budget_s=wait_s, poll_s=0.25, what=f"lock {name!r}")
        if not seen.ready:
            raise LockHeldError(seen.state)

    def _try_lock(self, name: str, *, owner: str, ttl_s: float) -> LockRecord | None:
        """Take the lock if free, ours, expired, or held by an owner known dead; else the holder's row.
        Taking another owner's lock (expired or dead) is recorded in the lock history."""
        now = self.clock.now()
        expires = now + timedelta(seconds=ttl_s)
        with self.engine.begin() as conn:
            try:
                conn.execute(locks.insert().values(name=name, owner=owner, acquired_at=now, expires_at=expires))
                return None
            except sa.exc.IntegrityError:
                pass
        with self.engine.begin() as conn:
            if conn.execute(locks.update().where(locks.c.name == name, locks.c.owner == owner)
                            .values(acquired_at=now, expires_at=expires)).rowcount == 1:
                return None
            row = conn.execute(sa.select(locks).where(locks.c.name == name)).mappings().first()
        if row is None:
            return self._try_lock(name, owner=owner, ttl_s=ttl_s)
        holder = LockRecord.from_row(row)
        reason: str | None
        if holder.expires_at < now:
            reason = (f"its lock expired at {holder.expires_at:%Y-%m-%d %H:%M:%S} UTC without renewal "
                      f"(held since {holder.acquired_at:%Y-%m-%d %H:%M:%S} UTC): its process stopped or stalled "
                      "past KB_LOCK_TTL; if it continues, its writes are fenced")
        else:
            reason = owner_gone(holder.owner, since=holder.acquired_at)
            if reason is None:
                return holder
        if self._take_over(name, holder, owner=owner, now=now, expires=expires, reason=reason):
            log.warning("kb_reindex: lock %r was held by %s (%s); taken over by %s", name, holder.owner, reason, owner)
            return None
        return self._try_lock(name, owner=owner, ttl_s=ttl_s)

    def _take_over(self, name: str, holder: LockRecord, *, owner: str, now: datetime, expires: datetime,
                   reason: str) -> bool:
        """Move the lock from `holder` (unless it changed meanwhile: renewed, released, taken), record it, and
        end the holder's run record, which would otherwise say "running" forever."""
        with self.engine.begin() as conn:
            taken = conn.execute(
                locks.update().where(locks.c.name == name, locks.c.owner == holder.owner,
                                     locks.c.expires_at == holder.expires_at)
                .values(owner=owner, acquired_at=now, expires_at=expires)
            ).rowcount
            if taken != 1:
                return False
            conn.execute(lock_events.insert().values(name=name, action="takeover", owner=holder.owner, by=owner,
                                                     at=now, reason=reason))
            dead_run, _, _ = holder.owner.rpartition("@")
            if dead_run:
                conn.execute(runs.update().where(runs.c.run_id == dead_run, runs.c.outcome == "running")
                             .values(outcome="failed", finished_at=now,
                                     error=f"lock taken over by {owner}: {reason}"[:4000]))
        return True

    def lock_held_by(self, name: str) -> str | None:
        """The owner of an unexpired lock of that name, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(locks.c.owner).where(locks.c.name == name, locks.c.expires_at >= self.clock.now())).first()
        return row[0] if row else None

    def holds_lock(self, name: str, *, owner: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(locks.c.owner).where(locks.c.name == name, locks.c.owner == owner)).first() is not None

    def list_locks(self, *, subject: str | None = None) -> list[LockRecord]:
        """Every lock row (for `status`), with whether its owner still lives, as far as this host can tell."""
        with self.engine.connect() as conn:
            rows = [LockRecord.from_row(r) for r in conn.execute(sa.select(locks).order_by(locks.c.name)).mappings()]
        if subject is not None:
            rows = [r for r in rows if r.name.split(":", 1)[-1] == subject]
        now = self.clock.now()
        return [replace(r, expired=r.expires_at < now, owner_alive=lock_owner_alive(r.owner, since=r.acquired_at))
                for r in rows]

    def break_lock(self, name: str, *, by: str, reason: str) -> LockRecord | None:
        """On-call's way out: delete the lock whoever holds it, and record who broke it and why."""
        now = self.clock.now()
        with self.engine.begin() as conn:
            holder = conn.execute(sa.select(locks).where(locks.c.name == name)).mappings().first()
            if holder is None:
                return None
            conn.execute(locks.delete().where(locks.c.name == name, locks.c.owner == holder["owner"]))
            conn.execute(lock_events.insert().values(name=name, action="unlock", owner=holder["owner"], by=by,
                                                     reason=reason, at=now))
        return LockRecord.from_row(holder)

    def lock_events(self, *, names: Iterable[str]) -> list[LockEvent]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(lock_events).where(lock_events.c.name.in_(list(names)))
                                .order_by(lock_events.c.id)).mappings().all()
        return [LockEvent(**row) for row in rows]

    def release_lock(self, name: str, *, owner: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(locks.delete().where(locks.c.name == name, locks.c.owner == owner))

    def renew_lock(self, name: str, *, owner: str, ttl_s: float) -> bool:
        """Push the expiry out again; False if the lock is no longer ours (it expired and was taken)."""
        with self.engine.begin() as conn:
            return conn.execute(
                locks.update().where(locks.c.name == name, locks.c.owner == owner)
                .values(expires_at=self.clock.now() + timedelta(seconds=ttl_s))
            ).rowcount == 1

    @contextmanager
    def renewing(self, name: str, *, owner: str, ttl_s: float) -> Iterator[None]:
        """A heartbeat renewing `owner`'s lock every third of the TTL for the block; a lost lock is logged
        and ends the heartbeat (the holder's next write decides), a failed renewal is tried again."""
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(ttl_s / 3):
                try:
                    if not self.renew_lock(name, owner=owner, ttl_s=ttl_s):
                        log.error("kb_reindex: lock %r held by %s was lost (expired and taken, or broken by on-call)",
                                  name, owner)
                        return
                except Exception as exc:  # the next beat tries again; the TTL is the backstop
                    log.warning("kb_reindex: renewing lock %r failed: %s", name, _first_line(exc))

        beat = threading.Thread(target=heartbeat, name=f"lock-heartbeat:{name}", daemon=True)
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()

    @contextmanager
    def lock(self, name: str, *, owner: str | None = None, ttl_s: float = 3600, wait_s: float = 0.0,
             waiter: Waiter | None = None) -> Iterator[str]:
        """Held for the whole block, however long: a heartbeat renews it every third of the TTL, so only a
        holder that died (and stopped renewing) loses it to the next run. `waiter`: how the wait for it passes
        (`acquire_lock`)."""
        owner = owner or default_lock_owner()
        self.acquire_lock(name, owner=owner, ttl_s=ttl_s, wait_s=wait_s, waiter=waiter)
        try:
            with self.renewing(name, owner=owner, ttl_s=ttl_s):
                yield owner
        finally:
            self.release_lock(name, owner=owner)


def parse_lock_owner(owner: str) -> tuple[str | None, int | None, str | None]:
    """(host, pid, space) from an owner made by `default_lock_owner`: `[run_id@]host:pid:nonce:space`."""
    _, _, tail = owner.rpartition("@")
    parts = tail.split(":")
    if len(parts) != 4 or not parts[1].isdigit():
        return None, None, None
    return parts[0], int(parts[1]), parts[3]


def _process_started_at(pid: int) -> datetime | None:
    """A process's start time from /proc (Linux), to tell a reused PID from the lock's owner."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), UTC).replace(tzinfo=None)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def owner_gone(owner: str, *, since: datetime) -> str | None:
    """Why the owner of an unexpired lock is known dead (for the lock history), or None."""
    if is_dag_run_owner(owner):
        alive, state = dag_run_alive(owner.rpartition("@")[0])
        return f"its DAG run is {state} in Airflow, no longer running" if alive is False else None
    if lock_owner_alive(owner, since=since) is False:
        return f"owner process is gone (held since {since:%Y-%m-%d %H:%M:%S} UTC)"
    return None


def lock_owner_alive(owner: str, *, since: datetime | None = None) -> bool | None:
    """True/False when this host can tell (the owner ran here, in this PID namespace; a DAG run's owner:
    Airflow, where it can be asked, says whether the run still runs), None for another host, container, an
    Airflow out of reach or an unknown owner (then only the TTL frees its lock).

    A PID that lives but started after the lock was taken is another process that reused the number."""
    if is_dag_run_owner(owner):
        return dag_run_alive(owner.rpartition("@")[0])[0]
    host, pid, space = parse_lock_owner(owner)
    if host is None or pid is None or host != socket.gethostname() or space != process_space() or space == "unknown":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    started = _process_started_at(pid)
    if since is not None and started is not None and started > since + timedelta(seconds=2):
        return False
    return True


def describe_lock_holder(name: str, holder: LockRecord) -> str:
    subject = name.split(":", 1)[-1]
    alive = lock_owner_alive(holder.owner, since=holder.acquired_at)
    host, _, _ = parse_lock_owner(holder.owner)
    if alive is None:
        where = f"held from host {host}" if host else "held by an owner of unknown host"
    else:
        where = "its process is alive on this host" if alive else "its process is gone"
    if is_dag_run_owner(holder.owner):
        where = ("an Airflow DAG run that Airflow reports running" if alive else
                 "an Airflow DAG run: its tasks renew it while the run lives; a run Airflow reports finished is "
                 "taken over at once, else the lock expires after KB_LOCK_TTL")
    return (f"another run is working on {subject}: {holder.owner}, since {holder.acquired_at:%Y-%m-%d %H:%M:%S} "
            f"UTC (lock {name!r}, expires {holder.expires_at:%Y-%m-%d %H:%M:%S} UTC; {where}). Wait for it; if it "
            f"is stuck, stop that process, or break the lock: `kb-reindex unlock --reason ... --yes`")
