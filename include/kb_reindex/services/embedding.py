"""Embedders: e5 in process (the default, `kb_reindex.services.e5`), the offline hashing one (deterministic, for tests)
and Ollama (production, bge-m3).

Chunks go through `embed`, questions through `embed_queries`: a model with a recipe (e5's `passage: ` and
`query: `, `layouts.embed_recipe`) embeds the two differently, and the recipe is part of the profile.

Every vector is checked before anyone can write it: the expected size and only finite numbers. A bad
vector stops the build; it is never stored.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import sys
import threading
import time
import unicodedata
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from kb_reindex.services.config import (
    DEFAULT_DIMS,
    DEFAULT_MODELS,
    EMBEDDERS,
    Settings,
    split_ollama_hosts,
)
from kb_reindex.domain.errors import (
    EmbedderUnavailable,
    ConfigError,
    EmbeddingError,
    ModelNotServed,
    connect_failure,
)
from kb_reindex.services.layouts import CHUNK_TEXT, EmbedRecipe, embed_recipe
from kb_reindex.domain.vectors import Vector, check_vectors

log = logging.getLogger(__name__)


class Embedder(Protocol):
    kind: str
    model: str
    recipe: EmbedRecipe

    @property
    def dimension(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> list[Vector]:
        """Chunks (documents), with the recipe's passage form."""
        ...

    def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        """Questions, with the recipe's query form."""
        ...

    def embed_batches(self, batches: Iterable[Sequence[str]]) -> Iterator[list[Vector]]:
        """Each batch's vectors in the batches' order (an embedder may have several requests in flight)."""
        ...


def batched(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# --- offline hashing embedder -------------------------------------------------------------------

#: the hashing embedder's own model names; any other name would label hashing vectors as a real model's
HASHING_MODEL_PREFIX = "hashing-"

_CJK = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKENS = re.compile(rf"[{_CJK}]+|[a-z0-9]+(?:\.[0-9]+)?")
_IS_CJK = re.compile(rf"[{_CJK}]")
_STOP_CHARS = set("的了是在吗呢么我你他她它们这那有和与及或就都也还很把被给让会要能可以请问啊吧呀哦嘛")
_STOP_BIGRAMS = {
    "可以", "什么", "怎么", "如何", "是否", "我们", "你们", "我的", "一个", "没有", "需要", "能否", "请问",
    "哪些", "多少", "时候", "的话", "一下", "这个", "那个", "如果", "还是", "应该", "能不", "不能", "了吗",
}


def hashing_features(text: str) -> Counter[str]:
    """Character uni- and bigrams for Chinese, words for Latin text and numbers; function words dropped."""
    features: Counter[str] = Counter()
    normalized = unicodedata.normalize("NFKC", text).lower()
    for token in _TOKENS.findall(normalized):
        if _IS_CJK.match(token):
            for char in token:
                if char not in _STOP_CHARS:
                    features["u:" + char] += 1
            for pair in zip(token, token[1:], strict=False):
                bigram = "".join(pair)
                if bigram not in _STOP_BIGRAMS and not (pair[0] in _STOP_CHARS and pair[1] in _STOP_CHARS):
                    features["b:" + bigram] += 2
        else:
            features["w:" + token] += 2
    return features


class HashingEmbedder:
    """Feature hashing with signs, sublinear term weights, L2-normalized. Offline and deterministic.

    The model name seeds the hash, so two "models" give unrelated vectors, as real models do.
    """

    kind = "hashing"
    recipe = CHUNK_TEXT

    def __init__(self, *, model: str = "hashing-ngram-v1", dim: int = 1024) -> None:
        if dim < 8:
            raise ConfigError(f"KB_EMBED_DIM={dim} is too small for the hashing embedder (minimum 8)")
        self.model = model
        self._dim = dim
        self._seed = zlib.crc32(model.encode("utf-8"))

    @property
    def dimension(self) -> int:
        return self._dim

    def embed_one(self, text: str) -> Vector:
        vector = np.zeros(self._dim, dtype=np.float64)
        for feature, count in hashing_features(text).items():
            h = zlib.crc32(feature.encode("utf-8"), self._seed)
            weight = 1.0 + math.log(count)
            vector[h % self._dim] += weight if (h >> 24) & 1 else -weight
        norm = float(np.linalg.norm(vector))
        if norm == 0.0:
            vector[zlib.crc32(b"\x00empty", self._seed) % self._dim] = 1.0
            norm = 1.0
        return (vector / norm).tolist()

    def embed(self, texts: Sequence[str]) -> list[Vector]:
        return [self.embed_one(text) for text in texts]

    def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        return self.embed(texts)

    def embed_batches(self, batches: Iterable[Sequence[str]]) -> Iterator[list[Vector]]:
        """Serial: the hashing embedder computes in this process; threads would only share its GIL."""
        for texts in batches:
            yield self.embed(texts)


# --- Ollama ------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """A host for messages: never the credentials that may sit in its userinfo."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


_OLLAMA_IMPORT = threading.Lock()


def import_ollama() -> ModuleType:
    """`import ollama`, the one way kb-reindex imports it. The package builds a default client from
    OLLAMA_HOST at import time, and a multi-server list (`http://a:11434,http://b:11434`) makes that raise
    `ValueError: Port could not be cast to integer value`. kb-reindex never uses that default client (every
    client it builds names its one server), so a list is hidden from the import alone."""
    if (imported := sys.modules.get("ollama")) is not None:
        return imported
    with _OLLAMA_IMPORT:
        listed = os.environ.get("OLLAMA_HOST", "")
        if "," not in listed:
            return importlib.import_module("ollama")
        del os.environ["OLLAMA_HOST"]
        try:
            return importlib.import_module("ollama")
        finally:
            os.environ["OLLAMA_HOST"] = listed


@dataclass
class _Host:
    """One Ollama server of the list: its client, the requests it has in flight and its cool-down."""

    url: str
    where: str  # the URL without credentials, for messages
    client: Any
    in_flight: int = 0
    down_until: float = 0.0  # the clock's time before which the host is passed over


class _Unavailable(Exception):
    """A failure that another attempt, later or on another server, may not repeat: refused, timed out, 5xx, 429."""


class OllamaEmbedder:
    """The `ollama` client's `embed`, batched, with a timeout, retries with backoff and a dimension check.

    An e5-family model gets e5's recipe from here (`passage: `/`query: ` before each text): Ollama embeds
    what it is sent.

    `host` may list several servers, comma-separated: each request goes to the server with the fewest
    requests in flight (in turn on a tie); a server that refuses or fails is passed over for `cooldown_s`
    while the others serve, then tried again. `concurrency` batch requests are in flight at once.
    """

    kind = "ollama"

    def __init__(
        self,
        *,
        host: str,
        model: str,
        dim: int | None = None,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 32,
        headers: dict[str, str] | None = None,
        concurrency: int = 1,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        ollama = import_ollama()
        if concurrency < 1:
            raise ConfigError(f"KB_EMBED_CONCURRENCY={concurrency} must be at least 1")
        self.model = model
        self.recipe = embed_recipe(self.kind, model)
        self.host = host
        self._dim = dim
        self._retries = retries
        self._backoff_s = backoff_s
        self._batch_size = batch_size
        self._concurrency = concurrency
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._hosts = [_Host(url, redact_url(url), ollama.Client(host=url, timeout=timeout_s, headers=headers or {}))
                       for url in split_ollama_hosts(host)]
        self._lock = threading.Lock()  # guards host choice, cool-downs and `calls` across request threads
        self._turn = 0
        self.calls = 0

    @property
    def hosts(self) -> list[str]:
        """The servers, credentials masked."""
        return [h.where for h in self._hosts]

    @property
    def dimension(self) -> int:
        """Probed from the model on first use when not configured (on every server), then checked on every answer."""
        if self._dim is None:
            self._dim = self._probe()
            log.info("kb_reindex: Ollama model %s answers %d-d vectors", self.model, self._dim)
        return self._dim

    def embed(self, texts: Sequence[str]) -> list[Vector]:
        return [vector for answer in self.embed_batches(batched(list(texts), self._batch_size)) for vector in answer]

    def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        self.dimension  # noqa: B018 - probed before the first request, as for chunks
        return [vector for batch in batched(self.recipe.queries(texts), self._batch_size)
                for vector in self._request(list(batch))]

    def embed_batches(self, batches: Iterable[Sequence[str]]) -> Iterator[list[Vector]]:
        """Each batch's vectors, in the order of the batches, with up to `concurrency` requests in flight.

        The batches are drawn in the caller's thread, only as far ahead as the requests in flight; whatever
        finishes first, answers are yielded in order. On an error the requests not yet sent are cancelled.
        """
        self.dimension  # noqa: B018 - probed once here, not by every request thread
        if self._concurrency == 1:
            for texts in batches:
                yield self._request(self.recipe.passages(texts))
            return
        source = (self.recipe.passages(texts) for texts in batches)
        pending: deque[Future[list[Vector]]] = deque()
        with ThreadPoolExecutor(max_workers=self._concurrency, thread_name_prefix="kb-embed") as pool:
            try:
                while True:
                    while len(pending) < self._concurrency:
                        sent = next(source, None)
                        if sent is None:
                            break
                        pending.append(pool.submit(self._request, sent))
                    if not pending:
                        return
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()

    def _request(self, texts: list[str]) -> list[Vector]:
        """One batch, on the least busy server not cooling down; a failure moves it to the next server, and
        when every server failed, another round follows after a backoff. Vectors are checked once the
        dimension is known."""
        failures: dict[str, str] = {}
        for attempt in range(self._retries + 1):
            if attempt:
                time.sleep(self._backoff_s * 2 ** (attempt - 1))
            tried: set[int] = set()
            while (host := self._acquire(tried)) is not None:
                try:
                    answer = self._call(host, texts)
                except _Unavailable as exc:
                    failures[host.where] = str(exc)
                    self._release(host, failed=True)
                    log.warning("kb_reindex: Ollama at %s failed (%s); attempt %d of %d%s", host.where, exc,
                                attempt + 1, self._retries + 1,
                                f"; passed over for {self._cooldown_s:g} s" if len(self._hosts) > 1 else "")
                    continue
                self._release(host, failed=False)
                if self._dim is None:
                    return [list(vector) for vector in answer]
                return check_vectors(answer, expected=len(texts), dim=self._dim, source=self._source(host))
        if len(self._hosts) == 1:
            where, last = next(iter(failures.items()))
            raise EmbedderUnavailable(f"Ollama at {where} failed after {self._retries + 1} attempts: {last}")
        raise EmbedderUnavailable(
            f"all {len(self._hosts)} Ollama servers failed, {self._retries + 1} attempts each: "
            + "; ".join(f"{where} ({failures.get(where, 'not reached')})" for where in self.hosts)
        )

    def _source(self, host: _Host) -> str:
        return f"Ollama model {self.model!r}" + (f" at {host.where}" if len(self._hosts) > 1 else "")

    def _acquire(self, tried: set[int]) -> _Host | None:
        """The server for the next attempt: not yet tried for this batch, healthy before cooling, fewest in
        flight, in turn on a tie. A server cooling down is tried only when no healthy one is left."""
        with self._lock:
            now = self._clock()
            untried = [i for i in range(len(self._hosts)) if i not in tried]
            if not untried:
                return None
            healthy = [i for i in untried if self._hosts[i].down_until <= now] or untried
            count = len(self._hosts)
            best = min(healthy, key=lambda i: (self._hosts[i].in_flight, (i - self._turn) % count))
            self._turn = (best + 1) % count
            host = self._hosts[best]
            host.in_flight += 1
            self.calls += 1
            tried.add(best)
            return host

    def _release(self, host: _Host, *, failed: bool) -> None:
        with self._lock:
            host.in_flight -= 1
            if failed:
                host.down_until = self._clock() + self._cooldown_s
            elif host.down_until:
                host.down_until = 0.0
                log.info("kb_reindex: Ollama at %s answers again", host.where)

    def _call(self, host: _Host, texts: list[str]) -> list[Sequence[float]]:
        """One attempt on one server: `_Unavailable` for what another attempt may not meet, an error for the rest."""
        import httpx

        ollama = import_ollama()
        try:
            return list(host.client.embed(model=self.model, input=texts).embeddings)
        except ollama.ResponseError as exc:
            if exc.status_code == 404:
                others = f" (one of the {len(self._hosts)} servers OLLAMA_HOST lists)" if len(self._hosts) > 1 else ""
                raise ModelNotServed(
                    f"embedding model {self.model!r} is not on the Ollama server at {host.where}{others}; "
                    f"run `ollama pull {self.model}` there"
                ) from None
            if exc.status_code not in (408, 429) and exc.status_code < 500:
                raise EmbeddingError(f"Ollama at {host.where} refused the request ({exc.status_code}): {exc.error}") from None
            raise _Unavailable(f"HTTP {exc.status_code}: {exc.error}") from None
        except (ConnectionError, httpx.ConnectError) as exc:
            raise _Unavailable(connect_failure(exc) or "connection failed") from None
        except httpx.TimeoutException:
            raise _Unavailable("timed out") from None
        except httpx.HTTPError as exc:
            raise _Unavailable(type(exc).__name__) from None

    def _probe(self) -> int:
        """The model's dimension, asked of every server: each that answers must serve the model and agree on
        its size (a server answering another model's vectors would mix them into one collection). A server
        down now is left to the build's failover; all down is the usual error after retries."""
        probe = self.recipe.passages(["dimension probe"])
        if len(self._hosts) == 1:
            return self._probe_answer(self._request(probe), self._hosts[0])
        sizes: dict[str, int] = {}
        down: dict[str, str] = {}
        for host in self._hosts:
            try:
                sizes[host.where] = self._probe_answer(self._call(host, probe), host)
            except _Unavailable as exc:
                down[host.where] = str(exc)
        if not sizes:
            return self._probe_answer(self._request(probe), None)
        if len(set(sizes.values())) > 1:
            raise EmbeddingError(
                f"the Ollama servers disagree on model {self.model!r}'s vector size: "
                + ", ".join(f"{where} {size}-d" for where, size in sizes.items())
                + "; every server OLLAMA_HOST lists must serve the same model"
            )
        for where, reason in down.items():
            log.warning("kb_reindex: Ollama at %s did not answer the dimension probe (%s); it is tried again "
                        "when embedding", where, reason)
        return next(iter(sizes.values()))

    def _probe_answer(self, answer: Sequence[Sequence[float]], host: _Host | None) -> int:
        if not answer or not answer[0]:
            at = f" at {host.where}" if host is not None and len(self._hosts) > 1 else ""
            raise EmbeddingError(f"Ollama model {self.model!r}{at} returned no vector for a probe text")
        return len(answer[0])


def check_model_served(settings: Settings, *, embedder: str, model: str, headers: dict[str, str] | None = None,
                       ask_server: bool = True) -> int | None:
    """Refuse, before anything is built, a model the embedder cannot serve: a collection is named after its
    model, so its vectors must be that model's. The offline hashing embedder serves only its own
    `hashing-*` names, e5 only the models it ships (`e5.E5_MODELS`); for Ollama the server decides (one
    probe text; `ask_server=False` leaves it to the build's own dimension probe). Returns the dimension the
    model answers where it is known (e5's own, or the server's), None otherwise (hashing builds any dimension)."""
    if embedder == "hashing":
        if not model.startswith(HASHING_MODEL_PREFIX):
            raise ModelNotServed(
                f"the hashing embedder cannot serve model {model!r}: it computes its own offline vectors and "
                f"serves only models named {HASHING_MODEL_PREFIX}* (default {DEFAULT_MODELS['hashing']}). "
                f"Use --embedder ollama for {model!r}, or leave the model empty for the embedder's default"
            )
    elif embedder == "e5":
        from kb_reindex.services.e5 import e5_model  # kb_reindex.services.e5 builds on this module

        return e5_model(model).dim
    elif embedder == "ollama":
        if ask_server:  # a model the server does not have raises ModelNotServed ("run `ollama pull ...`")
            return make_embedder(settings.with_embedder(embedder="ollama", model=model, dim=None),
                                 headers=headers).dimension
    else:
        raise ConfigError(f"embedder {embedder!r} is unknown; choose one of {', '.join(EMBEDDERS)}")
    return None


def make_embedder(settings: Settings, *, headers: dict[str, str] | None = None) -> Embedder:
    if settings.embedder == "hashing":
        return HashingEmbedder(model=settings.embed_model, dim=settings.embed_dim or DEFAULT_DIMS["hashing"])
    if settings.embedder == "e5":
        from kb_reindex.services.e5 import E5Embedder  # kb_reindex.services.e5 builds on this module

        return E5Embedder(model=settings.embed_model, dim=settings.embed_dim, batch_size=settings.embed_batch_size)
    if settings.embedder == "ollama":
        return OllamaEmbedder(
            host=settings.ollama_host,
            model=settings.embed_model,
            dim=settings.embed_dim,
            timeout_s=settings.ollama_timeout_s,
            batch_size=settings.embed_batch_size,
            headers=headers,
            concurrency=settings.embed_concurrency,
        )
    raise ConfigError(f"KB_EMBEDDER={settings.embedder!r} is unknown; choose one of {', '.join(EMBEDDERS)}")
