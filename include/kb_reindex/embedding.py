"""Embedders: the offline hashing one (default, deterministic) and Ollama (production, bge-m3).

Every vector is checked before anyone can write it: the expected size and only finite numbers. A bad
vector stops the build; it is never stored.
"""

from __future__ import annotations

import logging
import math
import re
import time
import unicodedata
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from kb_reindex.config import DEFAULT_MODELS, Settings
from kb_reindex.errors import ConfigError, EmbeddingError, ModelNotServed

log = logging.getLogger(__name__)

Vector = list[float]


class Embedder(Protocol):
    kind: str
    model: str

    @property
    def dimension(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> list[Vector]: ...


def batched(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def check_vectors(vectors: Sequence[Sequence[float]], *, expected: int, dim: int, source: str) -> list[Vector]:
    """Reject what must never be written: a missing vector, a wrong size, NaN or infinity.

    Checked as one array (the copy path moves thousands of vectors a second through here).
    """
    if len(vectors) != expected:
        raise EmbeddingError(f"{source} returned {len(vectors)} vectors for {expected} texts")
    for position, vector in enumerate(vectors):
        if len(vector) != dim:
            raise EmbeddingError(f"{source} returned a vector of size {len(vector)} (text {position}); expected {dim}")
    if not vectors:
        return []
    array = np.asarray(vectors, dtype=np.float64)
    finite = np.isfinite(array).all(axis=1)
    if not finite.all():
        position = int(np.argmin(finite))
        raise EmbeddingError(f"{source} returned a vector with NaN or infinite values (text {position})")
    nonzero = array.any(axis=1)
    if not nonzero.all():
        position = int(np.argmin(nonzero))
        raise EmbeddingError(f"{source} returned an all-zero vector (text {position}); cosine is undefined")
    return [v if isinstance(v, list) else list(map(float, v)) for v in vectors]


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
            for pair in zip(token, token[1:]):
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


# --- Ollama ------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """A host for messages: never the credentials that may sit in its userinfo."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class OllamaEmbedder:
    """The `ollama` client's `embed`, batched, with a timeout, retries with backoff and a dimension check."""

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
    ) -> None:
        import ollama

        self.model = model
        self.host = host
        self._dim = dim
        self._retries = retries
        self._backoff_s = backoff_s
        self._batch_size = batch_size
        self._client = ollama.Client(host=host, timeout=timeout_s, headers=headers or {})
        self.calls = 0

    @property
    def dimension(self) -> int:
        """Probed from the model on first use when not configured, then checked on every answer."""
        if self._dim is None:
            probe = self._request(["dimension probe"])
            if not probe or not probe[0]:
                raise EmbeddingError(f"Ollama model {self.model!r} returned no vector for a probe text")
            self._dim = len(probe[0])
            log.info("kb_reindex: Ollama model %s answers %d-d vectors", self.model, self._dim)
        return self._dim

    def embed(self, texts: Sequence[str]) -> list[Vector]:
        dim = self.dimension
        vectors: list[Vector] = []
        for batch in batched(list(texts), self._batch_size):
            answer = self._request(list(batch))
            vectors.extend(check_vectors(answer, expected=len(batch), dim=dim, source=f"Ollama model {self.model!r}"))
        return vectors

    def _request(self, texts: list[str]) -> list[Sequence[float]]:
        import httpx
        import ollama

        where = redact_url(self.host)
        last: str = ""
        for attempt in range(self._retries + 1):
            if attempt:
                time.sleep(self._backoff_s * 2 ** (attempt - 1))
            self.calls += 1
            try:
                return list(self._client.embed(model=self.model, input=texts).embeddings)
            except ollama.ResponseError as exc:
                if exc.status_code == 404:
                    raise ModelNotServed(
                        f"embedding model {self.model!r} is not on the Ollama server at {where}; "
                        f"run `ollama pull {self.model}` there"
                    ) from None
                if exc.status_code not in (408, 429) and exc.status_code < 500:
                    raise EmbeddingError(f"Ollama at {where} refused the request ({exc.status_code}): {exc.error}") from None
                last = f"HTTP {exc.status_code}: {exc.error}"
            except (ConnectionError, httpx.ConnectError):
                last = "connection refused"
            except httpx.TimeoutException:
                last = "timed out"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            log.warning("kb_reindex: Ollama at %s failed (%s); attempt %d of %d", where, last, attempt + 1, self._retries + 1)
        raise EmbeddingError(f"Ollama at {where} failed after {self._retries + 1} attempts: {last}")


def check_model_served(settings: Settings, *, embedder: str, model: str, headers: dict[str, str] | None = None,
                       ask_server: bool = True) -> None:
    """Refuse, before anything is built, a model the embedder cannot serve: a collection is named after its
    model, so its vectors must be that model's. The offline hashing embedder serves only its own
    `hashing-*` names; for Ollama the server decides (one probe text; `ask_server=False` leaves it to the
    build's own dimension probe)."""
    if embedder == "hashing":
        if not model.startswith(HASHING_MODEL_PREFIX):
            raise ModelNotServed(
                f"the hashing embedder cannot serve model {model!r}: it computes its own offline vectors and "
                f"serves only models named {HASHING_MODEL_PREFIX}* (default {DEFAULT_MODELS['hashing']}). "
                f"Use --embedder ollama for {model!r}, or leave the model empty for the embedder's default"
            )
    elif embedder == "ollama":
        if ask_server:  # a model the server does not have raises ModelNotServed ("run `ollama pull ...`")
            make_embedder(settings.with_embedder(embedder="ollama", model=model, dim=None), headers=headers).dimension
    else:
        raise ConfigError(f"embedder {embedder!r} is unknown; choose hashing or ollama")


def make_embedder(settings: Settings, *, headers: dict[str, str] | None = None) -> Embedder:
    if settings.embedder == "hashing":
        return HashingEmbedder(model=settings.embed_model, dim=settings.embed_dim or 1024)
    if settings.embedder == "ollama":
        return OllamaEmbedder(
            host=settings.ollama_host,
            model=settings.embed_model,
            dim=settings.embed_dim,
            timeout_s=settings.ollama_timeout_s,
            batch_size=settings.embed_batch_size,
            headers=headers,
        )
    raise ConfigError(f"KB_EMBEDDER={settings.embedder!r} is unknown; choose hashing or ollama")
