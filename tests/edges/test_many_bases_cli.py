"""Several knowledge bases in one deployment, through the CLI as a user runs it: `kb-reindex` processes with
KB_REGISTRY set (the shipped example registry: the shop's help centre and the sellers' rules). Each command
acts on the knowledge base it names, and only on it; one that writes refuses to guess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

CLI = Path(sys.executable).with_name("kb-reindex")
SHOP, SELLER = "mall_knowledge", "seller_rules"


def env_for(project: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
    env.update({"KB_PROJECT_ROOT": str(project), "KB_EMBEDDER": "hashing", "KB_REGISTRY": "knowledge/registry.yaml",
                **extra})
    return env


def cli(project: Path, *argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *argv], env=env_for(project, **extra), capture_output=True, text=True, timeout=180)


def cli_json(project: Path, *argv: str, code: int = 0, **extra: str) -> dict:
    done = cli(project, *argv, "--json", "-q", **extra)
    assert done.returncode == code, done.stdout + done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped knowledge and registry in a project of the module's own, both knowledge bases built once."""
    root = tmp_path_factory.mktemp("many-bases")
    shutil.copytree(REPO / "knowledge", root / "knowledge")
    assert cli_json(root, "--kb", SHOP, "run")["outcome"] == "promoted"
    assert cli_json(root, "run", KB_NAME=SELLER)["outcome"] == "promoted"  # KB_NAME names it as --kb does
    return root


def test_a_writing_command_without_a_knowledge_base_refuses_and_names_the_choices(project: Path) -> None:
    for argv in (["run"], ["rollback", "--reason", "x", "--yes"], ["freeze", "--reason", "x"], ["gc"], ["query", "退货"]):
        done = cli(project, *argv, "--json")
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        answer = json.loads(done.stdout)
        assert answer["error_kind"] == "config"
        assert f"name one with --kb or KB_NAME: {SHOP}, {SELLER}" in answer["error"], answer
    unknown = cli(project, "--kb", "nope", "status")
    assert unknown.returncode == 2 and "knowledge base 'nope' is not in the registry" in unknown.stderr
    # KB_ALIAS plays no part once a registry is set
    assert cli_json(project, "--kb", SELLER, "status", KB_ALIAS="something_else")["alias"] == SELLER


def test_each_knowledge_base_has_its_own_store_folder_collections_and_status(project: Path) -> None:
    assert sorted(p.name for p in (project / ".kb" / "qdrant").iterdir()) == [SHOP, SELLER]
    shop, seller = (cli_json(project, "--kb", kb, "status") for kb in (SHOP, SELLER))
    assert shop["live"]["collection"].startswith(f"{SHOP}__") and seller["live"]["collection"].startswith(f"{SELLER}__")
    assert (shop["live"]["points"], seller["live"]["points"]) == (50, 13)
    answer = cli_json(project, "--kb", SELLER, "query", "货款什么时候到账", "-k", "1")
    assert answer["results"][0]["knowledge_key"] == "settlement"
    # status with several and none named shows every one of them
    both = cli_json(project, "status")
    assert [s["alias"] for s in both["knowledge_bases"]] == [SHOP, SELLER] and both["refused"] == []
    human = cli(project, "status")
    assert human.returncode == 0 and f"== {SHOP} ==" in human.stdout and f"== {SELLER} ==" in human.stdout


def test_bases_lists_what_each_serves_its_model_freeze_and_last_run(project: Path) -> None:
    listed = {b["alias"]: b for b in cli_json(project, "bases")["knowledge_bases"]}
    assert list(listed) == [SHOP, SELLER]
    assert listed[SHOP]["live_version"] == 1 and listed[SHOP]["embed_model"] == "hashing-ngram-v1"
    assert listed[SELLER]["last_run"]["outcome"] == "promoted" and listed[SELLER]["schedule"] is None
    assert listed[SELLER]["source_poll_s"] == 15
    assert listed[SHOP]["dag_id"] == f"knowledge_reindex__{SHOP}" and listed[SHOP]["problems"] == []
    human = cli(project, "bases")
    # when each runs: the shop on its time schedule or a change of its source, the sellers on a change alone
    assert human.returncode == 0 and SHOP in human.stdout and "@daily + on change (every 15s)" in human.stdout


def test_freeze_rollback_retention_and_pins_act_on_the_one_named(project: Path) -> None:
    for kb, key in ((SHOP, "docs/coupon-rules.md"), (SELLER, "seller/docs/settlement.md")):
        path = project / "knowledge" / key
        path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：以最新公告为准。\n", encoding="utf-8")
        assert cli_json(project, "--kb", kb, "run")["outcome"] == "promoted"
    frozen = cli_json(project, "--kb", SHOP, "freeze", "--reason", "checking the coupon page")
    assert (frozen["frozen"], frozen["alias"]) == (True, SHOP)
    listed = {b["alias"]: b for b in cli_json(project, "bases")["knowledge_bases"]}
    assert (listed[SHOP]["frozen"], listed[SELLER]["frozen"]) == (True, False)
    # the seller's knowledge base promotes while the shop's is frozen
    path = project / "knowledge" / "seller" / "docs" / "penalties.md"
    path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：申诉材料需真实。\n", encoding="utf-8")
    assert cli_json(project, "--kb", SELLER, "run")["outcome"] == "promoted"
    assert cli_json(project, "--kb", SELLER, "pin", "--version", "1", "--reason", "baseline")["pinned"] is True
    rolled = cli_json(project, "--kb", SHOP, "rollback", "--reason", "coupon text", "--yes", "--live-version", "2")
    assert (rolled["from_version"], rolled["to_version"]) == (2, 1)
    shop, seller = (cli_json(project, "--kb", kb, "status") for kb in (SHOP, SELLER))
    assert shop["live"]["version"] == 1 and seller["live"]["version"] == 3, "the seller's alias did not move"
    assert shop["pinned"] == [] and seller["pinned"] == [1]
    assert [e["action"] for e in cli_json(project, "--kb", SELLER, "history")["events"]] == ["promote"] * 3
    cli_json(project, "--kb", SHOP, "unfreeze")
    assert cli_json(project, "--kb", SELLER, "gc")["pinned"] == [1]  # the seller's pin, not the shop's
    assert cli_json(project, "--kb", SHOP, "gc")["pinned"] == []
    assert cli_json(project, "--kb", SELLER, "status")["live"]["version"] == 3


def test_a_bad_entry_never_stops_the_good_ones_and_is_named(project: Path) -> None:
    registry = project / "knowledge" / "broken-registry.yaml"
    registry.write_text((project / "knowledge" / "registry.yaml").read_text(encoding="utf-8")
                        + "  wiki:\n    source: wiki\n    golden_set: golden.yaml\n    shedule: '@hourly'\n",
                        encoding="utf-8")
    broken = {"KB_REGISTRY": "knowledge/broken-registry.yaml"}
    done = cli(project, "--kb", SELLER, "status", "--json", **broken)
    assert done.returncode == 0 and json.loads(done.stdout)["alias"] == SELLER
    assert "broken-registry.yaml: knowledge base 'wiki': shedule: unknown key" in done.stderr
    refused = cli(project, "--kb", "wiki", "run", **broken)
    assert refused.returncode == 2
    assert "broken-registry.yaml: knowledge base 'wiki': shedule: unknown key (known: source," in refused.stderr
    # every entry listed, the refused one with its refusal; exit 2 naming it
    listed = cli_json(project, "bases", code=2, **broken)
    assert [b["alias"] for b in listed["knowledge_bases"]] == [SHOP, SELLER, "wiki"] and len(listed["refused"]) == 1
    assert "shedule: unknown key" in listed["knowledge_bases"][2]["registry_error"]
    human = cli(project, "bases", **broken)
    assert "shedule: unknown key" in human.stderr
    # the table stays one short line a knowledge base; the refusal is said in full below it
    table, below = human.stdout.split("\nPROBLEM: ", 1)
    assert max(map(len, table.splitlines())) < 160 and "1, below" in table, human.stdout
    assert below.startswith("wiki: ") and "shedule: unknown key" in below


def test_a_typo_in_a_served_entry_keeps_its_on_call_commands_and_shows_its_error(
        project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`schedule` typed `schedul` in the sellers' entry (which served and so was recorded in the state DB): its
    status still shows what serves, beside the error (exit 2); freeze and rollback act on it; status and bases over
    all list both knowledge bases (the one good entry never makes them refuse with "name one") and name the error.
    Removed from the registry, it keeps the same commands from its recorded entry and stays in the lists over all,
    named, until it is retired. In process (`main`): the same commands, without a Python start each."""
    from kb_reindex.cli import main

    for name in [k for k in os.environ if k.startswith("KB_") and not k.startswith("KB_TEST_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_EMBEDDER", "hashing")

    def kb(*argv: str, code: int = 0) -> tuple[dict, str]:
        done = main([*argv, "--json", "-q"])
        out, err = capsys.readouterr()
        assert done == code, out + err
        return json.loads(out), err

    monkeypatch.setenv("KB_REGISTRY", "knowledge/registry.yaml")
    page = project / "knowledge" / "seller" / "docs" / "listing-rules.md"
    page.write_text(page.read_text(encoding="utf-8") + "\n\n补充：标题不得含联系方式。\n", encoding="utf-8")
    assert kb("--kb", SELLER, "run")[0]["outcome"] == "promoted"  # a version to roll back to, its entry recorded
    monkeypatch.setenv("KB_REGISTRY", "knowledge/typo-registry.yaml")
    shipped = (project / "knowledge" / "registry.yaml").read_text(encoding="utf-8")
    (project / "knowledge" / "typo-registry.yaml").write_text(shipped.replace("    schedule: null", "    schedul: null"),
                                                             encoding="utf-8")
    seen, err = kb("--kb", SELLER, "status", code=2)
    live = seen["live"]["version"]
    assert seen["alias"] == SELLER and live >= 2 and seen["rollback_target"] is not None
    assert "knowledge base 'seller_rules': schedul: unknown key" in seen["registry_error"] and "schedul" in err
    assert main(["--kb", SELLER, "status"]) == 2 and "PROBLEM: registry:" in capsys.readouterr().out
    assert kb("--kb", SELLER, "freeze", "--reason", "typo drill")[0]["frozen"] is True
    kb("--kb", SELLER, "unfreeze")
    rolled, _ = kb("--kb", SELLER, "rollback", "--reason", "bad page", "--yes", "--live-version", str(live))
    assert (rolled["from_version"], rolled["to_version"]) == (live, seen["rollback_target"])
    # over all: both, the broken one with what it serves and its error; exit 2 naming it
    both, err = kb("status", code=2)
    assert "schedul: unknown key" in err
    answers = {a["alias"]: a for a in both["knowledge_bases"]}
    assert list(answers) == [SHOP, SELLER] and answers[SELLER]["live"]["version"] == seen["rollback_target"]
    assert answers[SHOP]["registry_error"] is None and "schedul" in answers[SELLER]["registry_error"]
    listed, _ = kb("bases", code=2)
    assert [b["alias"] for b in listed["knowledge_bases"]] == [SHOP, SELLER]
    assert any("schedul: unknown key" in p for p in listed["knowledge_bases"][1]["problems"])
    # removed from the registry: still seen from the entry the state DB recorded
    (project / "knowledge" / "shop-only.yaml").write_text(shipped.split("  seller_rules:")[0], encoding="utf-8")
    monkeypatch.setenv("KB_REGISTRY", "knowledge/shop-only.yaml")
    gone, _ = kb("--kb", SELLER, "status", code=2)
    assert gone["live"]["version"] == seen["rollback_target"] and "no longer in the registry" in gone["registry_error"]
    # and in the lists over all (a lone listed entry beside it too): what it serves, its error, exit 2 naming it
    both, err = kb("status", code=2)
    answers = {a["alias"]: a for a in both["knowledge_bases"]}
    assert list(answers) == [SHOP, SELLER] and answers[SELLER]["live"]["version"] == seen["rollback_target"]
    assert "no longer in the registry" in answers[SELLER]["registry_error"] and answers[SHOP]["registry_error"] is None
    assert "kb-reindex: error: registry: knowledge base 'seller_rules' is no longer in the registry" in err
    listed, err = kb("bases", code=2)
    assert [b["alias"] for b in listed["knowledge_bases"]] == [SHOP, SELLER] and "seller_rules" in err
    assert listed["knowledge_bases"][1]["live_version"] == seen["rollback_target"]
    # retired at last: it leaves the lists, which answer as for the shop alone
    kb("--kb", SELLER, "retire", "--reason", "sellers moved to the new portal")
    listed, err = kb("bases")
    assert [b["alias"] for b in listed["knowledge_bases"]] == [SHOP] and "seller_rules" not in err
    assert kb("status")[0]["alias"] == SHOP


def test_an_entrys_default_tenant_is_what_its_documents_without_one_serve(tmp_path: Path) -> None:
    """The sellers' pages name no tenant: they serve under the entry's `tenant`; changing it re-embeds them."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    registry = project / "knowledge" / "registry.yaml"
    shipped = registry.read_text(encoding="utf-8")
    registry.write_text(shipped.replace("    schedule: null", "    schedule: null\n    tenant: sellers"), encoding="utf-8")
    assert cli_json(project, "--kb", SELLER, "run")["outcome"] == "promoted"

    def hits(tenant: str) -> list[str]:
        answer = cli_json(project, "--kb", SELLER, "query", "货款什么时候到账", "--tenant", tenant)
        return [r["knowledge_key"] for r in answer["results"]]

    assert hits("sellers")[:1] == ["settlement"] and hits("default") == []
    assert cli_json(project, "--kb", SELLER, "run")["outcome"] == "no_change"
    registry.write_text(shipped.replace("    schedule: null", "    schedule: null\n    tenant: merchants"),
                        encoding="utf-8")
    moved = cli_json(project, "--kb", SELLER, "run")
    assert moved["outcome"] == "promoted" and moved["docs"]["changed"] == 3, moved["docs"]
    assert hits("merchants")[:1] == ["settlement"] and hits("sellers") == []


def test_retire_ends_a_knowledge_base_says_what_it_kept_and_refuses_it_everywhere_after(tmp_path: Path) -> None:
    """`kb-reindex retire` (issue 39 item 4) as on-call types it: recorded and said (exit 0, again on a rerun),
    the alias kept serving without --drop-collections; then every command on it is refused naming who retired it
    and how to undo (exit 2), its entry is refused in `bases`, and removed from the registry it has no stand-in;
    --drop-collections asks first, drops its collections and alias; --undo brings its stand-in back."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    registry = project / "knowledge" / "registry.yaml"
    assert cli_json(project, "--kb", SELLER, "run")["outcome"] == "promoted"
    collection = cli_json(project, "--kb", SELLER, "status")["live"]["collection"]

    retired = cli_json(project, "--kb", SELLER, "retire", "--reason", "sellers moved to the new portal")
    assert (retired["alias"], retired["already_retired"], retired["collections_kept"]) == (SELLER, False, True)
    assert retired["retirement"]["reason"] == "sellers moved to the new portal" and retired["retirement"]["retired_by"]
    assert retired["dropped"] is None and retired["registry_entry"] == str(registry)
    again = cli(project, "--kb", SELLER, "retire", "--reason", "again", "-q")
    assert again.returncode == 0, again.stderr
    assert f"{SELLER} was already retired by {retired['retirement']['retired_by']}" in again.stdout
    assert "kept: the alias seller_rules and its collections; the assistant keeps reading" in again.stdout
    assert f"its entry is still in {registry}: remove it" in again.stdout

    # refused on every command but the reader's, naming the entry, who, and how to undo
    for argv in (["status"], ["run"], ["rollback", "--reason", "x", "--yes"], ["freeze", "--reason", "x"]):
        done = cli(project, "--kb", SELLER, *argv, "-q")
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert f"{registry}: knowledge base 'seller_rules' was retired by" in done.stderr, (argv, done.stderr)
        assert "`kb-reindex --kb seller_rules retire --undo`" in done.stderr, argv
    answer = cli_json(project, "--kb", SELLER, "query", "货款什么时候到账", "-k", "1")
    assert answer["results"][0]["knowledge_key"] == "settlement", "the alias still serves what was live"
    listed = cli_json(project, "bases", code=2)
    assert [b["alias"] for b in listed["knowledge_bases"]] == [SHOP]
    assert [r for r in listed["refused"] if "seller_rules' was retired by" in r] == listed["refused"] != []

    # removed from the registry: no stand-in from its recorded entry any more
    (project / "knowledge" / "shop-only.yaml").write_text(registry.read_text(encoding="utf-8").split("  seller_rules:")[0],
                                                          encoding="utf-8")
    shop_only = {"KB_REGISTRY": "knowledge/shop-only.yaml"}
    gone = cli(project, "--kb", SELLER, "status", "--json", **shop_only)
    assert gone.returncode == 2 and "was retired by" in json.loads(gone.stdout)["error"], gone.stdout
    unknown = cli(project, "--kb", "nope", "retire", "--reason", "x", **shop_only)
    assert unknown.returncode == 2 and "knowledge base 'nope' is not in the registry" in unknown.stderr
    assert cli(project, "--kb", SELLER, "retire", **shop_only).returncode == 2  # no --reason

    # dropping asks first; with --yes the alias and every collection of it go, the records stay
    asked = cli(project, "--kb", SELLER, "retire", "--reason", "x", "--drop-collections", **shop_only)
    assert asked.returncode == 2 and "pass --yes" in asked.stderr
    dropped = cli_json(project, "--kb", SELLER, "retire", "--reason", "x", "--drop-collections", "--yes", **shop_only)
    assert dropped["already_retired"] and dropped["dropped"]["collections"] == [collection]
    assert dropped["dropped"]["alias_was"] == collection and dropped["retirement"]["collections_dropped"] is True
    assert dropped["registry_entry"] is None

    # undone: its stand-in is back (the entry is still removed), seeing the alias gone
    undone = cli_json(project, "--kb", SELLER, "retire", "--undo", **shop_only)
    assert undone["was_retired"] and undone["undone"]["reason"] == "sellers moved to the new portal"
    back = cli(project, "--kb", SELLER, "history", "--json", "-q", **shop_only)
    assert back.returncode == 0, back.stderr
    assert [e["action"] for e in json.loads(back.stdout)["events"]] == [
        "promote", "retire", "drop-collections", "unretire"]
