"""A local-mode Qdrant in its own process, standing in for a Qdrant server.

Local mode (`QdrantClient(":memory:")`) keeps every vector of every collection in the process that
holds the client. In production the vectors live in the Qdrant server, not in the engine; running the
store in a sidecar keeps the engine's peak RSS its own, and lets the store's memory be reported apart.

The sidecar is a fresh interpreter (`python bench/sidecar.py`, not a fork of the worker, so its RSS is
not the worker's copy-on-write pages) that serves one shared client through a
`multiprocessing.managers` server on a Unix socket. The worker gets an AutoProxy: every public
`QdrantClient` method, keyword arguments included, with results pickled back (pydantic models).
Each thread that uses a proxy opens its own connection and the server answers each connection in
its own thread, so concurrent readers behave as concurrent clients of one server.

`--store server` runs our Qdrant-protocol test server instead (`kb_reindex.testing.qdrant_server`: Qdrant's
REST API over one local-mode client, `:memory:` like the other stores), as a process of its own
on a free port; the engine reaches it through `KB_QDRANT_URL` and `store.make_client`, i.e. the real remote
client over HTTP/JSON, exactly as in production (REST; the test server speaks no gRPC).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import connection as mp_connection
from multiprocessing.managers import BaseManager, dispatch
from pathlib import Path
from typing import Any, NamedTuple

STORE_KINDS = ("sidecar", "inprocess", "server")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0

_shared_client: Any = None


def _client() -> Any:
    """The one client every proxy refers to (registered in the server process only)."""
    return _shared_client


class StoreManager(BaseManager):
    """Serves `client()`: a proxy to the sidecar's one shared QdrantClient."""


class Sidecar:
    """A running sidecar: its pid (for /proc peak-RSS windows), a way to get proxies, a clean stop."""

    def __init__(self, proc: subprocess.Popen[str], address: str, authkey: bytes, folder: tempfile.TemporaryDirectory[str]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.address = address
        self.authkey = authkey
        self._folder = folder
        self._manager = _ClientManager(address=address, authkey=authkey)
        self._manager.connect()

    def client(self) -> Any:
        """A proxy to the shared client; several proxies all see the same collections."""
        return self._manager.client()  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Ask the server to exit; terminate, then kill, if it does not within a few seconds."""
        if self.proc.poll() is None:
            try:
                conn = mp_connection.Client(self.address, authkey=self.authkey)
                try:
                    dispatch(conn, None, "shutdown")
                finally:
                    conn.close()
            except (OSError, EOFError):
                pass
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._folder.cleanup()


class _ClientManager(BaseManager):
    """The worker's side: knows the typeid, not the callable."""


_ClientManager.register("client")


class StoreHandle(NamedTuple):
    """What `qdrant_store` gives: a client, the store's pid (None in process), and, for a sidecar, where
    another process connects to the same store (`connect`); for the test server, its URL."""

    client: Any
    pid: int | None
    address: str | None = None
    authkey_hex: str | None = None
    url: str | None = None


def connect(address: str, authkey_hex: str) -> Any:
    """A proxy to a running sidecar's shared client, from any process that has its address and key."""
    manager = _ClientManager(address=address, authkey=bytes.fromhex(authkey_hex))
    manager.connect()
    return manager.client()  # type: ignore[attr-defined]


def start() -> Sidecar:
    """Start a sidecar and wait until it accepts connections."""
    folder = tempfile.TemporaryDirectory(prefix="kb-bench-store-")
    address = str(Path(folder.name) / "store.sock")
    authkey = secrets.token_bytes(32)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), address, str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(authkey.hex() + "\n")
        proc.stdin.close()
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not ready or ready[0].strip() != "ready":
            raise RuntimeError(f"store sidecar did not start (exit {proc.poll()}, said {ready[:1]!r})")
        return Sidecar(proc, address, authkey, folder)
    except BaseException:
        proc.kill()
        proc.wait()
        folder.cleanup()
        raise


@contextmanager
def qdrant_store(kind: str) -> Iterator[StoreHandle]:
    """A proxy to a sidecar's client (with its pid and address), or an in-process client.

    The sidecar is stopped when the block ends, on errors too.
    """
    if kind == "inprocess":
        from qdrant_client import QdrantClient

        client = QdrantClient(":memory:")
        try:
            yield StoreHandle(client, None)
        finally:
            client.close()
        return
    if kind == "server":
        with qdrant_server() as (url, pid):
            from qdrant_client import QdrantClient

            client = QdrantClient(url=url, timeout=120)
            try:
                yield StoreHandle(client, pid, url=url)
            finally:
                client.close()
        return
    if kind != "sidecar":
        raise ValueError(f"store kind must be one of {STORE_KINDS}, not {kind!r}")
    sidecar = start()
    try:
        yield StoreHandle(sidecar.client(), sidecar.pid, sidecar.address, sidecar.authkey.hex())
    finally:
        sidecar.stop()


@contextmanager
def qdrant_server() -> Iterator[tuple[str, int]]:
    """Our Qdrant-protocol test server in a process of its own, on a free port, in memory: (URL, pid).

    In memory (`--path :memory:`) as the other stores are: on a folder, local mode commits each point to
    SQLite by itself (about 3 ms a point here), which would time that commit rather than the wire.

    Started through this file (`--qdrant-server`) rather than `qdrant_server.start_process`, so that it
    also exits by itself if the worker that started it dies (a timed-out worker is killed, not stopped)."""
    import urllib.request

    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--qdrant-server", ":memory:",
                             str(os.getpid())],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(START_TIMEOUT_S)
        url = said[0].split()[4] if said and said[0].startswith("qdrant test double at ") else None
        if url is None:
            raise RuntimeError(f"qdrant test server did not start (exit {proc.poll()}, said {said[:1]!r})")
        with urllib.request.urlopen(url + "/", timeout=10) as answer:
            answer.read()
        yield url, proc.pid
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: the server closes its local-mode client and exits
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def server_requests(url: str, *, clear: bool = False) -> list[dict[str, Any]]:
    """The test server's request log (each with `handle_s`, `store_s`); `clear` empties it instead."""
    import json
    import urllib.request

    request = urllib.request.Request(url + "/__requests", method="DELETE" if clear else "GET")
    with urllib.request.urlopen(request, timeout=60) as answer:
        log = json.loads(answer.read())
    return [] if clear else log


def serve_qdrant(folder: str, parent: int) -> None:
    """`sidecar.py --qdrant-server DIR PARENT_PID`: the test server on a free port, until SIGTERM or the
    worker's death."""
    from kb_reindex.testing.qdrant_server import main as qdrant_server_main

    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    qdrant_server_main(["--port", "0", "--path", folder])


# --- the sidecar process -----------------------------------------------------------------------


def client_methods(cls: type) -> tuple[str, ...]:
    """The public methods of the client class. AutoProxy's default probes every attribute, and some
    QdrantClient properties (`grpc_collections`) raise in local mode; properties are not proxied anyway."""
    import inspect

    return tuple(name for name, value in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_"))


def exit_with_parent(parent: int) -> None:
    """A worker killed by run.py's timeout cannot stop its sidecar or scenario processes; they exit once
    it is gone (run in a daemon thread)."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def serve(address: str, parent: int, authkey: bytes) -> None:
    global _shared_client
    import warnings

    from qdrant_client import QdrantClient

    # the engine silences this around its own call, but it is raised here, in the store's process
    warnings.filterwarnings("ignore", message="Payload indexes have no effect in the local Qdrant")

    _shared_client = QdrantClient(":memory:")
    StoreManager.register("client", callable=_client, exposed=client_methods(type(_shared_client)))
    server = StoreManager(address=address, authkey=authkey).get_server()
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "--qdrant-server":
        serve_qdrant(sys.argv[2], int(sys.argv[3]))
    else:
        serve(sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.stdin.readline().strip()))
