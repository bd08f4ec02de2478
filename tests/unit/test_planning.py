"""The plan and the build's results as typed values: they cross XCom and JSON as the dicts they always were."""

from __future__ import annotations

import json

from kb_reindex.domain.model import RunKind
from kb_reindex.steps.plan import plan
from kb_reindex.domain.planning import (
    AuditMode,
    AuditResult,
    BuildResult,
    ChunkCounts,
    CreatedVersion,
    DocCounts,
    DocKeys,
    Plan,
)
from kb_reindex.services.runtime import Deps

#: the keys of the plan dict (`kb-reindex plan --json`, the plan task's XCom), in their order
PLAN_KEYS = ["alias", "kind", "fingerprint", "embedder", "embed_model", "embed_dim", "chunking_version",
             "embed_profile", "payload_layout", "base_version", "base_collection", "base_embed_model", "force_full",
             "no_change", "docs", "doc_keys", "chunks", "source_changed_at", "notes", "warnings"]
#: the keys of a plan's audit of live (`kb_reindex.rules.audit.audit_live`), in their order; a sampled one adds `sampled`
AUDIT_KEYS = ["version", "collection", "expected", "points", "missing", "orphans", "missing_ratio", "orphan_ratio",
              "mode"]


def a_plan(**changes: object) -> Plan:
    fields: dict[str, object] = dict(
        alias="kb", kind=RunKind.MIGRATION, fingerprint="f" * 64, embedder="ollama", embed_model="bge-m3",
        embed_dim=None, chunking_version="c1", embed_profile=None, payload_layout="native", base_version=3,
        base_collection="kb__bge-m3__v3", base_embed_model="bge-m3", force_full=True, no_change=False,
        docs=DocCounts(added=1, changed=2, unchanged=3, removed=4), doc_keys=DocKeys.first(
            added=[f"k{n}" for n in range(60)], changed=["b"], removed=[]),
        chunks=ChunkCounts(total=10, embedded=10, reused=0), source_changed_at=1.5, notes=("a note",))
    fields.update(changes)
    return Plan(**fields)  # type: ignore[arg-type]


def test_a_plan_crosses_json_and_back_unchanged() -> None:
    plan = a_plan()
    data = plan.to_dict()
    assert list(data) == PLAN_KEYS
    assert data["kind"] == "migration" and type(data["kind"]) is str
    assert data["docs"] == {"added": 1, "changed": 2, "unchanged": 3, "removed": 4}
    assert len(data["doc_keys"]["added"]) == 50, "a plan names at most 50 keys of each kind"
    assert Plan.from_dict(json.loads(json.dumps(data))) == plan
    audit = AuditResult(version=3, collection="kb__bge-m3__v3", expected=5, points=5, missing=0, orphans=0,
                        missing_ratio=0.0, orphan_ratio=0.0, mode=AuditMode.SAMPLE, sampled=5)
    snapshotted = a_plan(audit=audit).with_snapshot(version=4, collection="kb__v4", resumed=True)
    data = snapshotted.to_dict()
    assert list(data) == [*PLAN_KEYS, "audit", "version", "collection", "resumed"]
    assert list(data["audit"]) == [*AUDIT_KEYS, "sampled"] and data["audit"]["mode"] == "sample"
    assert Plan.from_dict(json.loads(json.dumps(data))) == snapshotted
    assert list(AuditResult.from_dict({**data["audit"], "mode": "full", "sampled": None}).to_dict()) == AUDIT_KEYS


def test_a_plan_from_before_payload_layouts_reads_as_native() -> None:
    data = a_plan().to_dict()
    del data["payload_layout"], data["embed_profile"]
    assert Plan.from_dict(data).payload_layout == "native" and Plan.from_dict(data).embed_profile is None


def test_a_plan_is_read_by_attribute_its_json_by_key() -> None:
    plan = a_plan()
    assert plan.to_dict()["docs"] == {"added": 1, "changed": 2, "unchanged": 3, "removed": 4}
    assert plan.base_version == 3 and plan.audit is None and plan.version is None
    assert not hasattr(plan, "__getitem__") and not hasattr(plan, "get")


def test_build_results_keep_their_dict_shape() -> None:
    assert BuildResult(version=2, embedded=0, copied=0, skipped=7).to_dict() == {
        "version": 2, "embedded": 0, "copied": 0, "skipped": 7}
    built = BuildResult(version=2, embedded=1, copied=2, skipped=3, points=6, copy_s=0.25)
    assert BuildResult.from_dict(built.to_dict()) == built
    created = CreatedVersion(version=2, collection="kb__v2", resumed=False, embed_model="m", embed_dim=8)
    assert CreatedVersion.from_dict(json.loads(json.dumps(created.to_dict()))) == created


def test_a_real_plan_round_trips(deps: Deps) -> None:
    planned = plan(deps)
    assert planned.kind is RunKind.REINDEX and planned.docs.added == planned.docs.current > 0
    assert list(planned.to_dict()) == PLAN_KEYS
    assert Plan.from_dict(json.loads(json.dumps(planned.to_dict()))) == planned
