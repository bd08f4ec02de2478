"""Vectors as the engine passes them, and the check that every embedder's answer passes before a write."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kb_reindex.domain.errors import EmbeddingError

Vector = list[float]


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
