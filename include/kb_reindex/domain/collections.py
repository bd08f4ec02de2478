"""How a version's Qdrant collection is named: pure naming, so a command that only reads the state DB (history,
status's names) need not import Qdrant's client."""

from __future__ import annotations


def collection_name(alias: str, model: str, version: int) -> str:
    return f"{alias}__{model_slug(model)}__v{version}"


def model_slug(model: str) -> str:
    """`bge-m3:latest` -> `bge-m3`; anything but letters, digits and '-' becomes '-'."""
    base = model.split(":")[0] if model.endswith(":latest") else model
    slug = "".join(ch if ch.isascii() and (ch.isalnum() or ch == "-") else "-" for ch in base.lower())
    return "-".join(part for part in slug.split("-") if part) or "model"
