"""Qdrant's client, as every module of the package imports it: without building all its REST models up front.

qdrant-client's `qdrant_client.http` ends its import by calling pydantic's `model_rebuild` on each of its REST
models, 223 of them incomplete until then: about 0.3-0.5 s of every process that opens Qdrant (a third of the
client's import), paid by each CLI command (a rollback too) and each Airflow task. Pydantic completes a model by
itself the first time the model validates or serialises anything, from the same module namespace, so that loop
is skipped here while the client is imported and a process builds only the models it uses (milliseconds).

Only the first import in a process is affected (one already imported elsewhere is taken as it is), and pydantic's
own `model_rebuild` is back in place before anything else runs. The package imports `QdrantClient` and
`models` from here, never from `qdrant_client` first (tests/unit/test_structure.py checks the import sites).
"""

from __future__ import annotations

import sys
from typing import Any


def _skip_rebuild(cls: type, *args: Any, **kwargs: Any) -> None:
    return None


def _import_client() -> None:
    if "qdrant_client" in sys.modules:
        return
    import pydantic

    rebuild = pydantic.BaseModel.__dict__["model_rebuild"]
    pydantic.BaseModel.model_rebuild = classmethod(_skip_rebuild)  # type: ignore[assignment,method-assign]
    try:
        import qdrant_client  # noqa: F401
    finally:
        pydantic.BaseModel.model_rebuild = rebuild  # type: ignore[method-assign]


_import_client()

from qdrant_client import QdrantClient as QdrantClient  # noqa: E402
from qdrant_client import models as models  # noqa: E402

__all__ = ["QdrantClient", "models"]
