"""Collection settings a production Qdrant needs: HNSW, on-disk storage, quantization, sharding.

Configured by ``KB_QDRANT_COLLECTION_CONFIG`` (JSON or YAML, inline or a file) or the ``collection_config``
extra of the ``qdrant_default`` Connection, with Qdrant's own field names, validated once by qdrant-client's
models into a `CollectionConfig`. Unconfigured keys are inherited from the live collection, so a reindex never quietly drops the
settings an operator gave the collection serving today. The effective settings are written into the new
collection's metadata (``collection_config``), where status reads them back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import pydantic
from kb_reindex.services.qdrant import models

from kb_reindex.domain.errors import ConfigError

#: Qdrant's built-in HNSW ``m``: what the graph is restored to after a bulk load when nothing says otherwise
DEFAULT_HNSW_M = 16
QUANTIZATION_KINDS = ("scalar", "binary")


class CreateArguments(TypedDict):
    """Keyword arguments of `QdrantClient.create_collection`, in the client's own types."""

    vectors_config: models.VectorParams
    hnsw_config: models.HnswConfigDiff | None
    on_disk_payload: bool | None
    shard_number: int | None
    replication_factor: int | None
    write_consistency_factor: int | None
    quantization_config: NotRequired[models.ScalarQuantization | models.BinaryQuantization]


class CollectionConfig(pydantic.BaseModel, extra="forbid", frozen=True):
    """The keys kb-reindex accepts, in Qdrant's names and with qdrant-client's models for the nested parts;
    a field left None is not configured (inherited from the live collection, or Qdrant's default). Built by
    `validate_collection_config` (or `from_dict`); `to_dict` is the JSON recorded in the collection's
    metadata and shown by status."""

    hnsw_config: models.HnswConfigDiff | None = None
    on_disk: bool | None = pydantic.Field(default=None, description="vectors on disk (VectorParams.on_disk)")
    on_disk_payload: bool | None = None
    quantization_config: models.ScalarQuantization | models.BinaryQuantization | None = None
    shard_number: pydantic.PositiveInt | None = None
    replication_factor: pydantic.PositiveInt | None = None
    write_consistency_factor: pydantic.PositiveInt | None = None

    @pydantic.field_validator("hnsw_config")
    @classmethod
    def _hnsw_bounds(cls, value: models.HnswConfigDiff | None) -> models.HnswConfigDiff | None:
        # qdrant-client's model types the fields; Qdrant's schema adds these bounds, checked here rather than
        # by a failing create request half-way into a run
        if value is not None:
            if value.m is not None and value.m < 0:
                raise ValueError(f"m={value.m} must be at least 0")
            if value.ef_construct is not None and value.ef_construct < 4:
                raise ValueError(f"ef_construct={value.ef_construct} must be at least 4")
        return value

    @pydantic.model_validator(mode="after")
    def _consistency(self) -> CollectionConfig:
        if self.write_consistency_factor and self.write_consistency_factor > (self.replication_factor or 1):
            raise ValueError(f"write_consistency_factor={self.write_consistency_factor} exceeds replication_factor="
                             f"{self.replication_factor or 1}: no write could ever be acknowledged")
        return self

    @classmethod
    def from_dict(cls, data: Any, *, source: str) -> CollectionConfig:
        """Settings recorded by `to_dict` (a collection's metadata), validated again; errors name `source`."""
        return validate_collection_config(data, source=source)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON values, only the configured keys, in the model's field order."""
        return self.model_dump(mode="json", exclude_none=True)

    @property
    def hnsw_m(self) -> int:
        """The graph degree the collection should have once loaded."""
        m = self.hnsw_config.m if self.hnsw_config is not None else None
        return DEFAULT_HNSW_M if m is None else m

    def with_hnsw_m(self) -> CollectionConfig:
        """These settings with an explicit HNSW `m` (Qdrant's default when none is configured)."""
        hnsw = self.hnsw_config or models.HnswConfigDiff()
        return self.model_copy(update={"hnsw_config": hnsw.model_copy(update={"m": self.hnsw_m})})

    def create_arguments(self, *, dim: int, distance: models.Distance, defer_indexing: bool) -> CreateArguments:
        """Keyword arguments of `QdrantClient.create_collection` for these settings.

        `defer_indexing`: HNSW `m=0` while the collection is bulk-loaded, which Qdrant's bulk-upload guide
        recommends over `indexing_threshold=0` (segments are still optimized, without a graph, so memory stays
        low); `restore_indexing` sets the real `m` afterwards."""
        hnsw = self.hnsw_config
        if defer_indexing:
            hnsw = (hnsw or models.HnswConfigDiff()).model_copy(update={"m": 0})
        arguments = CreateArguments(
            vectors_config=models.VectorParams(size=dim, distance=distance, on_disk=self.on_disk),
            # an HNSW config that sets nothing (`hnsw_config: {}`) is not sent
            hnsw_config=hnsw if hnsw is not None and hnsw.model_dump(exclude_none=True) else None,
            on_disk_payload=self.on_disk_payload,
            shard_number=self.shard_number,
            replication_factor=self.replication_factor,
            write_consistency_factor=self.write_consistency_factor,
        )
        if self.quantization_config is not None:
            arguments["quantization_config"] = self.quantization_config
        return arguments


def load_collection_config(raw: str | Mapping[str, Any], *, source: str, root: Path) -> CollectionConfig:
    """A mapping, a JSON/YAML string, or a path to a JSON/YAML file (relative to the project root) ->
    validated settings. Every error names `source` and the key at fault."""
    text_source = source
    if isinstance(raw, str):
        text = raw.strip()
        if not text.startswith(("{", "[")) and "\n" not in text and ":" not in text:
            path = Path(text).expanduser()
            path = path if path.is_absolute() else root / path
            if not path.is_file():
                raise ConfigError(f"{source}={text!r} is neither a file nor a JSON/YAML mapping")
            text, text_source = path.read_text(encoding="utf-8"), f"{source} ({path})"
        import yaml  # JSON is YAML: one parser for both

        from kb_reindex.services.yaml_input import load_yaml

        try:
            raw = load_yaml(text, where=text_source)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{text_source} is not valid JSON or YAML: {' '.join(str(exc).split())}") from None
    return validate_collection_config(raw, source=text_source)


def validate_collection_config(raw: Any, *, source: str) -> CollectionConfig:
    if raw is None:
        return CollectionConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must be a mapping of collection settings, not {type(raw).__name__}")
    quantization = raw.get("quantization_config")
    if isinstance(quantization, Mapping) and set(quantization) - set(QUANTIZATION_KINDS):
        raise ConfigError(f"{source}: quantization_config: use {' or '.join(QUANTIZATION_KINDS)} "
                          f"(e.g. {{scalar: {{type: int8}}}}); got {', '.join(sorted(map(str, quantization)))}")
    try:
        parsed = CollectionConfig.model_validate(dict(raw))
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error.get("loc", ()) if not str(part)[:1].isupper()) or "(top level)"
        message = error.get("msg", "invalid")
        if error.get("type") == "extra_forbidden":
            message = f"unknown key (allowed: {', '.join(_allowed_keys(error.get('loc', ())))})"
        value = error.get("input")
        shown = f" (got {json.dumps(value, default=str)})" if error.get("type") != "extra_forbidden" and \
            not isinstance(value, Mapping) else ""
        raise ConfigError(f"{source}: {where}: {message}{shown}") from None
    return parsed


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[pydantic.BaseModel] = CollectionConfig
    if loc and loc[0] == "hnsw_config":
        model = models.HnswConfigDiff
    elif loc and loc[0] == "quantization_config":
        return ["scalar", "binary"] if len(loc) <= 2 else ["type", "quantile", "always_ram", "memory"]
    return sorted(model.model_fields)


def from_collection(info: models.CollectionInfo) -> CollectionConfig:
    """The settings of an existing collection, in the same keys: what a new version inherits."""
    params = info.config.params
    found: dict[str, Any] = {}
    hnsw = info.config.hnsw_config.model_dump(mode="json", exclude_none=True) if info.config.hnsw_config else {}
    hnsw = {k: v for k, v in hnsw.items() if k in ("m", "ef_construct", "full_scan_threshold", "on_disk", "payload_m")}
    if hnsw:
        found["hnsw_config"] = hnsw
    vectors = params.vectors
    if isinstance(vectors, models.VectorParams) and vectors.on_disk is not None:
        found["on_disk"] = vectors.on_disk
    for key in ("on_disk_payload", "shard_number", "replication_factor", "write_consistency_factor"):
        if getattr(params, key, None) is not None:
            found[key] = getattr(params, key)
    quantization = info.config.quantization_config
    if isinstance(quantization, (models.ScalarQuantization, models.BinaryQuantization)):
        found["quantization_config"] = quantization.model_dump(mode="json", exclude_none=True)
    return validate_collection_config(found, source="the live collection's settings")


def effective(configured: CollectionConfig | None, inherited: CollectionConfig | None) -> CollectionConfig:
    """Configured keys win; HNSW is merged field by field (configuring `m` keeps live's `ef_construct`)."""
    configured = configured if configured is not None else CollectionConfig()
    if inherited is None:
        return configured
    chosen = {name: value for name in CollectionConfig.model_fields
              if (value := getattr(configured, name)) is not None}
    if configured.hnsw_config is not None and inherited.hnsw_config is not None:
        chosen["hnsw_config"] = inherited.hnsw_config.model_copy(
            update=configured.hnsw_config.model_dump(exclude_none=True))
    return inherited.model_copy(update=chosen)
