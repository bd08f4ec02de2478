"""The registry of knowledge bases (KB_REGISTRY): every entry's settings, resolved against the file's folder
over the environment's defaults, and every mistake refused once, naming the file, the knowledge base and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO
from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.registry import RegistryEntry, load_registry, select_knowledge_base


def write_registry(folder: Path, body: str) -> dict[str, str]:
    (folder / "kb").mkdir(parents=True, exist_ok=True)
    (folder / "kb" / "golden.yaml").write_text("probes: []\n", encoding="utf-8")
    path = folder / "kb" / "registry.yaml"
    path.write_text(body, encoding="utf-8")
    return {"KB_PROJECT_ROOT": str(folder), "KB_REGISTRY": "kb/registry.yaml", "KB_EMBEDDER": "hashing"}


TWO = """knowledge_bases:
  shop:
    source: shop-docs
    golden_set: golden.yaml
    chunk_size: 300
    keep_versions: 4
  wiki:
    source: /srv/wiki
    golden_set: golden.yaml
    schedule: null
    embedder: ollama
    model: bge-m3
    dimension: 1024
    qdrant_conn_id: qdrant_wiki
"""


def test_without_a_registry_the_environment_is_one_knowledge_base_with_todays_dag_ids(tmp_path: Path) -> None:
    registry = load_registry({"KB_PROJECT_ROOT": str(tmp_path), "KB_ALIAS": "help", "KB_REINDEX_SCHEDULE": "@hourly"})
    [kb] = registry.bases
    assert (kb.alias, kb.schedule, kb.registered) == ("help", "@hourly", False)
    assert (kb.dag_id("knowledge_reindex"), kb.pool) == ("knowledge_reindex", "kb_qdrant_writes")
    settings = kb.settings({"KB_PROJECT_ROOT": str(tmp_path), "KB_ALIAS": "help"})
    assert settings.qdrant_path == tmp_path / ".kb" / "qdrant"
    assert load_registry({"KB_PROJECT_ROOT": str(tmp_path), "KB_REINDEX_SCHEDULE": ""}).bases[0].schedule is None


def test_entries_resolve_against_the_registry_folder_and_override_the_environment(tmp_path: Path) -> None:
    env = {**write_registry(tmp_path, TWO), "KB_KEEP_VERSIONS": "1", "KB_CHUNK_OVERLAP": "20",
           "KB_ALIAS": "ignored", "KB_QDRANT_PATH": "store"}
    registry = load_registry(env)
    assert registry.names == ["shop", "wiki"] and registry.errors == ()
    shop, wiki = registry.bases
    s = shop.settings(env)
    assert (s.alias, s.knowledge_dir, s.golden_set) == ("shop", tmp_path / "kb" / "shop-docs", tmp_path / "kb" / "golden.yaml")
    assert (s.chunk_size, s.chunk_overlap, s.keep_versions, s.embedder) == (300, 20, 4, "hashing")
    # each knowledge base has its own local-mode folder: two never wait for one store
    assert s.qdrant_path == tmp_path / "store" / "shop" and wiki.settings(env).qdrant_path == tmp_path / "store" / "wiki"
    w = wiki.settings(env)
    assert (w.knowledge_dir, w.embedder, w.embed_model, w.embed_dim) == (Path("/srv/wiki"), "ollama", "bge-m3", 1024)
    assert (shop.schedule, wiki.schedule) == ("@daily", None)
    assert (wiki.qdrant_conn_id, wiki.ollama_conn_id, shop.qdrant_conn_id) == ("qdrant_wiki", "ollama_default",
                                                                               "qdrant_default")
    assert [kb.dag_id("knowledge_rollback") for kb in registry.bases] == ["knowledge_rollback__shop",
                                                                          "knowledge_rollback__wiki"]
    assert (shop.pool, wiki.pool) == ("kb_qdrant_writes__shop", "kb_qdrant_writes__wiki")


def test_a_command_names_its_knowledge_base_or_the_only_one_is_used(tmp_path: Path) -> None:
    env = write_registry(tmp_path, TWO)
    assert select_knowledge_base("wiki", env).alias == "wiki"
    assert select_knowledge_base(None, {**env, "KB_NAME": "shop"}).alias == "shop"
    with pytest.raises(ConfigError, match=r"2 knowledge bases are registered .*--kb or KB_NAME: shop, wiki"):
        select_knowledge_base(None, env)
    with pytest.raises(ConfigError, match=r"knowledge base 'nope' is not in the registry .*choose one of shop, wiki"):
        select_knowledge_base("nope", env)
    one = write_registry(tmp_path / "one", "knowledge_bases:\n  solo:\n    source: d\n    golden_set: golden.yaml\n")
    assert select_knowledge_base(None, one).alias == "solo"


@pytest.mark.parametrize(("body", "message"), [
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    shedule: '@hourly'\n",
     r"registry.yaml: knowledge base 'shop': shedule: unknown key \(known: source, golden_set, schedule"),
    ("knowledge_bases:\n  shop:\n    golden_set: golden.yaml\n", r"knowledge base 'shop': source: missing"),
    ("knowledge_bases:\n  shop__v2:\n    source: d\n", r"knowledge base 'shop__v2': not an alias Qdrant and Airflow"),
    ("knowledge_bases:\n  'shop knowledge':\n    source: d\n", r"knowledge base 'shop knowledge': not an alias"),
    ("knowledge_bases:\n  shop:\n    source: d\n  shop:\n    source: e\n", r"registry.yaml: line 4: 'shop' is given twice"),
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: nothere.yaml\n",
     r"knowledge base 'shop': golden_set: .*kb/nothere.yaml does not exist"),
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    source_poll_s: -5\n",
     r"knowledge base 'shop': source_poll_s: Input should be greater than or equal to 0"),
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    source_quiet_s: soon\n",
     r"knowledge base 'shop': source_quiet_s: Input should be a valid number"),
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    chunk_size: 20\n",
     r"knowledge base 'shop': chunk_size: Input should be greater than or equal to 50"),
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    chunk_size: 100\n    chunk_overlap: 60\n",
     r"knowledge base 'shop': chunk_overlap=60 must be less than half of chunk_size=100"),
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    embedder: openai\n",
     r"knowledge base 'shop': embedder: 'openai' is unknown"),
    # a schedule Airflow cannot compute would parse without an error and then never run on time
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    schedule: '@dayly'\n",
     r"knowledge base 'shop': schedule: '@dayly' is not a cron expression \(five fields, as '0 3 \* \* \*'\) or a preset \(@hourly, @daily"),
    ("knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n    schedule: '0 25 * * *'\n",
     r"knowledge base 'shop': schedule: '0 25 \* \* \*' is not a cron expression"),
])
def test_a_bad_entry_is_refused_naming_the_file_the_knowledge_base_and_the_key(tmp_path: Path, body: str,
                                                                              message: str) -> None:
    env = write_registry(tmp_path, body)
    try:
        registry = load_registry(env)
    except ConfigError as exc:  # the file as a whole (a key given twice)
        errors = [str(exc)]
    else:
        errors = list(registry.errors)
        with pytest.raises(ConfigError):
            registry.check()
    assert len(errors) == 1
    assert re.search(message, errors[0]), errors[0]


@pytest.mark.parametrize("schedule", ["'@daily'", "'@quarterly'", "'@hourly'", "'0 3 * * *'", "'*/15 * * * 1-5'",
                                      "null", "''"])
def test_a_cron_expression_or_preset_or_none_is_a_schedule(tmp_path: Path, schedule: str) -> None:
    env = write_registry(tmp_path, f"knowledge_bases:\n  shop:\n    source: d\n    golden_set: golden.yaml\n"
                                   f"    schedule: {schedule}\n")
    registry = load_registry(env)
    assert registry.errors == () and registry.names == ["shop"]
    assert registry.bases[0].schedule == (None if schedule in ("null", "''") else schedule.strip("'"))


def test_an_entry_without_schedule_is_refused_when_the_environments_schedule_is_no_cron(tmp_path: Path) -> None:
    env = {**write_registry(tmp_path, TWO), "KB_REINDEX_SCHEDULE": "daily"}
    registry = load_registry(env)
    assert registry.names == ["wiki"]  # its `schedule: null` is its own
    assert registry.errors == (f"{tmp_path / 'kb' / 'registry.yaml'}: knowledge base 'shop': schedule: unset, so "
                               "KB_REINDEX_SCHEDULE: 'daily' is not a cron expression (five fields, as '0 3 * * *') or "
                               "a preset (@hourly, @daily, @weekly, @monthly, @quarterly, @yearly); null: triggered and "
                               "watched runs only",)


def test_a_bad_entry_keeps_the_good_ones(tmp_path: Path) -> None:
    env = write_registry(tmp_path, TWO + "  broken:\n    golden_set: golden.yaml\n")
    registry = load_registry(env)
    assert registry.names == ["shop", "wiki"]
    assert registry.errors == (f"{tmp_path / 'kb' / 'registry.yaml'}: knowledge base 'broken': source: missing",)
    assert select_knowledge_base("shop", env).alias == "shop"
    with pytest.raises(ConfigError, match="knowledge base 'broken': source: missing"):
        select_knowledge_base("broken", env)


def test_a_broken_entry_keeps_a_stand_in_for_on_call_from_its_recorded_entry_or_its_alias_alone(tmp_path: Path) -> None:
    from kb_reindex.services.registry import stand_in

    env = write_registry(tmp_path, TWO.replace("    schedule: null\n", "    schedul: null\n")
                         + "  'bad alias!':\n    source: x\n")
    registry = load_registry(env)
    assert registry.names == ["shop"] and len(registry.errors) == 2
    # an alias Airflow takes keeps on-call's surface; one it cannot take has none
    assert list(registry.broken) == ["wiki"] and "wiki': schedul: unknown key" in registry.broken["wiki"]
    (alone,) = registry.stand_ins(env)
    assert (alone.alias, alone.registered, alone.problem, alone.recorded_at) == ("wiki", True, registry.broken["wiki"],
                                                                                   None)
    assert alone.dag_id("knowledge_rollback") == "knowledge_rollback__wiki"
    assert alone.settings(env).qdrant_path == tmp_path / ".kb" / "qdrant" / "wiki", "its own store folder, as an entry's"
    # from the entry as it last loaded: its Connection and settings, not the environment's
    wiki = load_registry(write_registry(tmp_path / "good", TWO)).get("wiki")
    recorded = wiki.recorded()
    assert recorded.qdrant_conn_id == "qdrant_wiki" and recorded.env["KB_EMBED_MODEL"] == "bge-m3"
    kept = stand_in("wiki", registry=registry.path, problem="typo", recorded=recorded)
    assert (kept.qdrant_conn_id, kept.schedule, kept.problem) == ("qdrant_wiki", None, "typo")
    assert kept.settings(env).embed_model == "bge-m3"
    # naming none: the refusal says why there is no only one, and names the broken entry among the choices
    with pytest.raises(ConfigError, match=r"2 refused: .*schedul: unknown key.*; name one with --kb or KB_NAME: "
                                          r"shop, wiki"):
        load_registry(write_registry(tmp_path / "two", TWO.replace("    schedule: null\n", "    schedul: null\n")
                                     + "  third:\n    source: y\n    chunk_size: 1\n")).select(None, {})


@pytest.mark.parametrize(("body", "message"), [
    ("", r"one top-level key, knowledge_bases \(found: NoneType\)"),
    ("bases: {}\n", r"one top-level key, knowledge_bases \(found: \['bases'\]\)"),
    ("knowledge_bases: {}\n", "it lists none"),
    ("knowledge_bases: [\n", "not valid YAML"),
])
def test_a_file_that_is_no_registry_is_refused_as_a_whole(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_registry(write_registry(tmp_path, body))
    with pytest.raises(ConfigError, match=r"KB_REGISTRY='missing.yaml': .*missing.yaml does not exist"):
        load_registry({"KB_PROJECT_ROOT": str(tmp_path), "KB_REGISTRY": "missing.yaml"})


def test_the_shipped_registry_holds_the_shop_and_a_second_knowledge_base() -> None:
    registry = load_registry({"KB_PROJECT_ROOT": str(REPO), "KB_REGISTRY": "knowledge/registry.yaml"})
    assert registry.names == ["mall_knowledge", "seller_rules"] and registry.errors == ()
    shop, seller = (kb.settings({"KB_PROJECT_ROOT": str(REPO)}) for kb in registry.bases)
    assert shop.knowledge_dir == REPO / "knowledge" / "docs" and shop.golden_set == REPO / "knowledge" / "golden.yaml"
    assert seller.knowledge_dir == REPO / "knowledge" / "seller" / "docs"
    assert sorted(p.name for p in seller.knowledge_dir.glob("*.md")) == ["listing-rules.md", "penalties.md",
                                                                         "settlement.md"]


def test_a_task_of_an_entry_uses_the_connections_the_entry_names(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """In a DAG task, `wiki` (qdrant_conn_id: qdrant_wiki) reaches its own Qdrant; `shop` the default
    Connection's; an entry naming a Connection Airflow does not have is refused, naming both."""
    pytest.importorskip("airflow")
    from types import SimpleNamespace

    from kb_reindex.airflow import connections

    env = write_registry(tmp_path, TWO)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    defined = {"qdrant_wiki": SimpleNamespace(host="qdrant-wiki", port=6333, password=None, extra_dejson={}),
               "qdrant_default": SimpleNamespace(host="qdrant-shop", port=6334, password=None, extra_dejson={})}
    monkeypatch.setattr(connections, "_connection", defined.get)
    wiki, _ = connections.task_settings("wiki")
    shop, _ = connections.task_settings("shop")
    assert (wiki.alias, wiki.qdrant_host, wiki.qdrant_path) == ("wiki", "qdrant-wiki", None)
    assert (shop.alias, shop.qdrant_host, shop.qdrant_port) == ("shop", "qdrant-shop", 6334)
    monkeypatch.setattr(connections, "_connection", {"qdrant_default": defined["qdrant_default"]}.get)
    with pytest.raises(ConfigError, match=r"knowledge base 'wiki' names the Connection 'qdrant_wiki', which Airflow"):
        connections.task_settings("wiki")


def test_aliases_that_differ_only_by_case_are_refused_and_a_shared_source_is_said(tmp_path: Path) -> None:
    env = write_registry(tmp_path, TWO + "  Shop:\n    source: other-docs\n    golden_set: golden.yaml\n"
                                         "  shop-copy:\n    source: shop-docs\n    golden_set: golden.yaml\n")
    registry = load_registry(env)
    path = tmp_path / "kb" / "registry.yaml"
    assert registry.names == ["shop", "wiki", "shop-copy"]
    assert registry.errors == (f"{path}: knowledge base 'Shop': its alias differs from 'shop' only by case; rename "
                               "one (the first is kept)",)
    assert registry.warnings == (f"{path}: knowledge bases shop, shop-copy all read {tmp_path / 'kb' / 'shop-docs'}: "
                                 "each builds and serves it on its own; if that is not meant, give each its own "
                                 "source",)
    assert load_registry(write_registry(tmp_path / "plain", TWO)).warnings == ()


def test_an_entry_with_several_wrong_keys_names_every_one(tmp_path: Path) -> None:
    env = write_registry(tmp_path, "knowledge_bases:\n  shop:\n    golden_set: golden.yaml\n    schedul: '@daily'\n"
                                   "    chunk_size: 20\n")
    [error] = load_registry(env).errors
    assert error.endswith("knowledge base 'shop': source: missing; chunk_size: Input should be greater than or "
                          "equal to 50; schedul: unknown key (known: " + ", ".join(RegistryEntry.model_fields) + ")"), error


def test_an_entry_without_golden_set_has_its_folders_golden_yaml_or_explicitly_none(tmp_path: Path) -> None:
    """Never the environment's golden set (the shop's probes, about pages the entry does not have): its source
    folder's golden.yaml, else `NoGoldenSet` naming where to add one, kept in the entry the state DB records.
    The single form keeps KB_GOLDEN_SET or knowledge/golden.yaml."""
    from kb_reindex.domain.validation_model import NoGoldenSet
    from kb_reindex.services.registry import stand_in

    env = {**write_registry(tmp_path, "knowledge_bases:\n  own:\n    source: own-docs\n  bare:\n    source: bare-docs\n"
                                      "  bucket:\n    source: s3://wiki-bucket/pages\n"),
           "KB_GOLDEN_SET": str(tmp_path / "kb" / "golden.yaml")}  # the environment's: taken by none of them
    (tmp_path / "kb" / "own-docs").mkdir()
    (tmp_path / "kb" / "own-docs" / "golden.yaml").write_text("probes: []\n", encoding="utf-8")
    registry = load_registry(env)
    assert registry.errors == ()
    own, bare, bucket = (registry.get(alias) for alias in ("own", "bare", "bucket"))
    assert own.settings(env).golden_set == tmp_path / "kb" / "own-docs" / "golden.yaml"
    where = f"{tmp_path / 'kb' / 'registry.yaml'}'s entry"
    assert bare.settings(env).golden_set == NoGoldenSet(entry=f"{where} bare")
    assert bucket.settings(env).golden_set == NoGoldenSet(entry=f"{where} bucket")  # a bucket: no folder to look in
    assert NoGoldenSet(entry=f"{where} bare").text == (
        f"no golden set: answers were not probed; add golden_set to {where} bare")
    # as the state DB records it: on-call's stand-in still knows it has none
    recorded = bare.recorded()
    assert stand_in("bare", registry=None, problem="removed", recorded=recorded).settings(env).golden_set == (
        NoGoldenSet(entry=f"{where} bare"))
    # the single form, as it was
    single = load_registry({"KB_PROJECT_ROOT": str(tmp_path)}).bases[0].settings({"KB_PROJECT_ROOT": str(tmp_path)})
    assert single.golden_set == tmp_path / "knowledge" / "golden.yaml"
    assert load_registry(env | {"KB_REGISTRY": ""}).bases[0].settings(env).golden_set == tmp_path / "kb" / "golden.yaml"
