"""multilingual-e5-small, the embedded default: its recipe, the same vectors over the Ollama protocol, a hashing
-> e5 migration, and every release gate deciding right on real semantics.

The rest of the suite embeds with the hashing embedder (conftest); here the model is loaded once (the engine
is cached per process) and the shipped corpus is built with it once per module: v1 with hashing, then the
migration to e5 (v2, live), on which each gate test plans a candidate from an edited corpus (unchanged chunks
are copied, so only the edited ones are embedded) and puts the corpus back afterwards.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from qdrant_client import QdrantClient

from kb_reindex.steps import querylog

from kb_reindex.run.pipeline import RunResult, run_reindex
from kb_reindex.services.config import Settings
from kb_reindex.services.e5 import E5Embedder
from kb_reindex.services.embedding import OllamaEmbedder, check_model_served, make_embedder
from kb_reindex.domain.errors import ConfigError, ModelNotServed
from kb_reindex.services.layouts import CHUNK_TEXT, E5_RECIPE, embed_recipe, embedding_profile
from kb_reindex.reader import search_knowledge
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.store import KnowledgeStore

from conftest import REPO, settings_for, write_doc

ALIAS = "mall_knowledge"
# customer questions about member points that are not in the golden set; live answers them with member-rules
REAL_QUERIES = ["积分兑换的商品可以退吗", "银卡会员每年有几张运费券", "会员成长值怎么算", "积分抵扣现金的比例是多少"]


# --- the recipe and the settings (no model loaded) --------------------------------------------------


def test_e5_is_the_default_embedder_with_its_model_dimension_and_recipe() -> None:
    settings = Settings.from_env({})
    assert (settings.embedder, settings.embed_model, settings.embed_dim) == ("e5", "multilingual-e5-small", 384)
    embedder = make_embedder(settings)
    assert (embedder.kind, embedder.dimension, embedder.recipe) == ("e5", 384, E5_RECIPE)
    with pytest.raises(ConfigError, match="KB_EMBED_DIM=1024, but multilingual-e5-small answers 384-d vectors"):
        make_embedder(Settings.from_env({"KB_EMBED_DIM": "1024"}))
    with pytest.raises(ModelNotServed, match="the e5 embedder cannot serve model 'bge-m3'.*--embedder ollama"):
        check_model_served(settings, embedder="e5", model="bge-m3")


@pytest.mark.parametrize("model, recipe", [
    ("multilingual-e5-small", E5_RECIPE), ("jeffh/intfloat-multilingual-e5-small:f16", E5_RECIPE),
    ("intfloat/e5-base-v2", E5_RECIPE), ("multilingual-e5-large-instruct", CHUNK_TEXT),
    ("e5-mistral-7b-instruct", CHUNK_TEXT), ("bge-m3", CHUNK_TEXT),
])
def test_an_e5_family_model_on_ollama_gets_e5s_recipe(model: str, recipe: object) -> None:
    assert embed_recipe("ollama", model) == recipe
    assert OllamaEmbedder(host="http://127.0.0.1:9", model=model, dim=384).recipe == recipe


def test_migrate_offers_e5() -> None:
    from kb_reindex.cli import _parser

    args = _parser().parse_args(["migrate", "--embedder", "e5"])
    assert (args.embedder, args.model) == ("e5", None)


def test_the_recipe_is_part_of_the_profile() -> None:
    """Vectors are reused only between equal profiles: the same model embedded without e5's prefixes is
    another profile, and hashing's profile is what it always was."""
    parts = {"embedder": "ollama", "model": "multilingual-e5-small", "dim": 384, "distance": "Cosine",
             "chunking_version": "c1"}
    assert embedding_profile(**parts) == embedding_profile(**parts, recipe=E5_RECIPE.name)
    assert embedding_profile(**parts) != embedding_profile(**parts, recipe=CHUNK_TEXT.name)
    hashing = {**parts, "embedder": "hashing", "model": "hashing-ngram-v1", "dim": 1024}
    assert embedding_profile(**hashing) == embedding_profile(**hashing, recipe="chunk-text-v1")


# --- the same vectors in process and over the Ollama protocol ---------------------------------------


@pytest.fixture(scope="module")
def e5_server() -> Iterator[str]:
    """`python -m kb_reindex.testing.ollama_server --embedder e5` on a free port, as a user starts it."""
    command = [sys.executable, "-m", "kb_reindex.testing.ollama_server", "--embedder", "e5", "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        match = re.search(r"at (http://\S+)", line)
        served = "multilingual-e5-small (e5 vectors, dim 384)"
        assert match and served in line, line + (proc.stderr.read() if proc.stderr else "")
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_ollama_server_with_e5_gives_the_vectors_of_the_in_process_embedder(e5_server: str) -> None:
    chunks = ["退换货政策 > 退货运费谁承担 因质量问题退货的，运费由商家承担。", "积分规则"]
    questions = ["my package arrived broken, what can I do"]
    over_the_wire = OllamaEmbedder(host=e5_server, model="multilingual-e5-small")
    assert over_the_wire.dimension == 384 and over_the_wire.recipe == E5_RECIPE
    in_process = E5Embedder()
    for wire, local in ((over_the_wire.embed(chunks), in_process.embed(chunks)),
                        (over_the_wire.embed_queries(questions), in_process.embed_queries(questions))):
        cosines = (np.asarray(wire) * np.asarray(local)).sum(axis=1)
        assert cosines.min() >= 0.999, cosines
    # a chunk's vector is not its question's: the recipe was applied, once
    assert float(np.dot(in_process.embed(questions)[0], in_process.embed_queries(questions)[0])) < 0.99
    # a client that forgets e5's recipe is told so, as the model would silently answer worse
    answer = httpx.post(f"{e5_server}/api/embed", json={"model": "multilingual-e5-small", "input": ["积分规则"]})
    assert answer.status_code == 400 and "lacks e5's prefix" in answer.json()["error"]


# --- a hashing -> e5 migration, then the gates on e5 vectors ---------------------------------------------


@pytest.fixture(scope="module")
def e5_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deps, RunResult]]:
    """The shipped corpus live with hashing (v1), then migrated to e5 (v2): (deps, the migration's result)."""
    root = tmp_path_factory.mktemp("e5") / "project"
    shutil.copytree(REPO / "knowledge", root / "knowledge")
    settings = settings_for(root, KB_EMBEDDER="hashing")
    client = QdrantClient(":memory:")
    state = StateStore(settings.state_url)
    deps = Deps(settings=settings, state=state, store=KnowledgeStore(client))
    assert run_reindex(deps).outcome == "promoted"
    migrated = run_reindex(deps, kind="migration", embedder="e5")
    yield deps, migrated
    state.dispose()
    client.close()


@pytest.fixture
def e5_deps(e5_live: tuple[Deps, RunResult]) -> Iterator[Deps]:
    """e5 live, the query log on; the knowledge folder and golden set put back as they were afterwards."""
    deps, migrated = e5_live
    assert migrated.outcome == "promoted"
    knowledge = deps.settings.root / "knowledge"
    saved = {path: path.read_bytes() for path in knowledge.rglob("*") if path.is_file()}
    querylog.reset_cache()
    settings = deps.settings.with_embedder(embedder="e5", model="multilingual-e5-small", dim=384)
    yield replace(deps, settings=replace(settings, query_log=True))
    querylog.reset_cache()
    for path in knowledge.rglob("*"):
        if path.is_file() and path not in saved:
            path.unlink()
    for path, data in saved.items():
        path.write_bytes(data)


def set_golden(deps: Deps, **fields: object) -> None:
    path = deps.settings.golden_set
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.update(fields)
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")


def live_version(deps: Deps) -> int:
    return deps.state.live_version(ALIAS).version


def recorded(deps: Deps, result: RunResult) -> dict:
    """The candidate's whole validation record (a run's result carries its summary)."""
    return deps.state.get_version(ALIAS, result.version).validation


def test_a_hashing_to_e5_migration_is_validated_promoted_and_reported_side_by_side(e5_live: tuple[Deps, RunResult]) -> None:
    deps, migrated = e5_live
    assert migrated.outcome == "promoted" and migrated.version == 2
    live = deps.state.live_version(ALIAS)
    assert (live.embedder, live.embed_model, live.embed_dim) == ("e5", "multilingual-e5-small", 384)
    assert deps.store.collection_metadata(live.collection)["embed_recipe"] == E5_RECIPE.name
    validation = recorded(deps, migrated)
    # the calibrated thresholds of knowledge/golden.yaml hold on e5 with room (0.9 / 0.8)
    assert validation["compared_as"] == "side_by_side" and validation["hit_rate"] >= 0.95 and validation["mrr"] >= 0.9
    assert validation["live_embed_model"] == "hashing-ngram-v1" and validation["live_hit_rate"] is not None
    markdown = Path(validation["report"]).read_text(encoding="utf-8")
    section = markdown[markdown.index("## Models side by side"):]
    assert "| live v1 | hashing | hashing-ngram-v1 | 1024 |" in section
    scores = f"{validation['hit_rate']} | {validation['mrr']}"
    assert f"| candidate v2 | e5 | multilingual-e5-small | 384 | {scores} |" in section
    assert "Models side by side" in Path(validation["report"]).with_suffix(".html").read_text(encoding="utf-8")


def test_english_questions_find_the_chinese_pages(e5_deps: Deps) -> None:
    found = search_knowledge(e5_deps, "my package arrived broken, what can I do", k=3)
    assert found.embed_model == "multilingual-e5-small"
    assert {r.knowledge_key for r in found.results} <= {"shipping-policy", "after-sales-guide", "return-policy"}
    assert search_knowledge(e5_deps, "Can I use my points to pay part of an order?", k=1).results[0].knowledge_key == \
        "member-rules"


def test_an_edit_that_removes_the_answer_a_probe_needs_fails_the_golden_gate(e5_deps: Deps) -> None:
    """The after-sales page loses its list of what to send (photos, the unboxing video): the probe asking
    whether a missing part needs an unboxing video no longer finds the page; the totals still pass."""
    path = e5_deps.settings.knowledge_dir / "after-sales-guide.md"
    text = path.read_text(encoding="utf-8")
    path.write_text(re.sub(r"## 需要准备的材料.*?(?=## 审核时效)", "", text, flags=re.DOTALL), encoding="utf-8")
    before = live_version(e5_deps)
    result = run_reindex(e5_deps)
    assert result.outcome == "failed" and live_version(e5_deps) == before
    validation = recorded(e5_deps, result)
    assert validation["hit_rate"] >= 0.9 and validation["mrr"] >= 0.8  # the absolute thresholds would pass
    assert [p["probe"] for p in validation["probes"] if p["regression"]] == ["aftersales-missing-parts"]
    assert [f.split(" (")[0] for f in validation["failures"]] == ["1 regression(s) against live v2"]


def test_a_category_that_loses_its_answers_is_caught_by_the_category_gate(e5_deps: Deps) -> None:
    # totals, regressions and the paired test set aside: the category gate alone decides
    set_golden(e5_deps, min_hit_rate=0.5, min_mrr=0.3, max_regressions=10, paired_alpha=1e-9)
    write_doc(e5_deps.settings.root, "member-rules",
              "---\ntitle: 会员规则\ncategory: 会员\ntenant: default\n---\n\n# 会员规则\n\n本页正在整理中。\n")
    result = run_reindex(e5_deps)
    assert result.outcome == "failed"
    validation = result.validation
    assert len(validation.failures) == 1 and validation.failures[0].startswith("category 会员:")
    rows = {c["category"]: c for c in validation.by_category}
    assert rows["会员"]["dropped"] and not any(r["dropped"] for name, r in rows.items() if name != "会员")


def test_a_new_page_that_crowds_out_unchanged_answers_is_caught_by_replay(e5_deps: Deps) -> None:
    assert [[r.knowledge_key for r in search_knowledge(e5_deps, q, k=1).results] for q in REAL_QUERIES] == \
        [["member-rules"]] * 4
    sections = "\n\n".join(f"## 问题{i}\n\n" + (q + "。") * 3 for i, q in enumerate(REAL_QUERIES))
    write_doc(e5_deps.settings.root, "faq-extra",
              f"---\ntitle: 常见问题\ncategory: 其他\ntenant: default\n---\n\n# 常见问题\n\n{sections}")
    result = run_reindex(e5_deps)
    assert result.outcome == "failed"
    validation = result.validation
    assert validation.regressions == 0 and [f for f in validation.failures if not f.startswith("replay:")] == []
    assert validation.replay.lost_top_hits == 4 and "replay.max_lost_top_hits" in result.error


def test_a_harmless_edit_passes_every_gate_and_is_promoted(e5_deps: Deps) -> None:
    search_knowledge(e5_deps, REAL_QUERIES[0], k=1)  # something to replay
    path = e5_deps.settings.knowledge_dir / "after-sales-guide.md"
    path.write_text(path.read_text(encoding="utf-8") + "\n\n人工客服服务时间调整为每天9:00至21:00，节假日照常服务。\n",
                    encoding="utf-8")
    before = live_version(e5_deps)
    result = run_reindex(e5_deps)
    assert result.outcome == "promoted", result.error
    assert result.validation.failures == () and result.validation.regressions == 0
    # the edited page's chunks searched against the shipped pages: none is a near-duplicate at KB_DUPLICATE_COSINE
    assert result.warnings == ()
    # only the edited page's chunks were embedded again; the others' e5 vectors were copied from live, or kept
    # where the build's slot held them already (the version model's difference)
    build = result.build
    assert 0 < result.chunks.embedded < build.copied + build.kept and live_version(e5_deps) > before


def test_near_copies_of_a_page_are_named_as_duplicates_with_the_threshold_calibrated_on_e5(e5_deps: Deps) -> None:
    """The trial's near-copies of one page, retitled (one with a sentence added): each is a `duplicate` warning
    naming the copy and the page, at or above the cosine calibrated on e5 (bench/duplicates.py)."""
    text = (e5_deps.settings.knowledge_dir / "return-policy.md").read_text(encoding="utf-8")
    write_doc(e5_deps.settings.root, "return-policy-2026", text.replace("退换货政策", "退换货政策（2026版）"))
    write_doc(e5_deps.settings.root, "return-policy-faq", text.replace("退换货政策", "退货常见问题").replace(
        "制定以下退换货政策。", "制定以下退换货政策。如有疑问，请联系在线客服。"))
    result = run_reindex(e5_deps)
    duplicates = [w for w in result.warnings if w.kind == "duplicate"]
    assert {(w.knowledge_key, w.other_key) for w in duplicates if w.other_key == "return-policy"} == {
        ("return-policy-2026", "return-policy"), ("return-policy-faq", "return-policy")}
    assert all(w.score >= e5_deps.settings.duplicate_cosine == 0.975 for w in duplicates if w.score is not None)
    assert all("return-policy-" in w.knowledge_key + w.other_key for w in duplicates), duplicates
