"""A knowledge base in a bucket (`KB_KNOWLEDGE_DIR=s3://bucket/prefix`), against moto's S3 server over real HTTP
(`kb_reindex.testing.s3_server`, started here on 127.0.0.1): edits, additions and removals detected exactly as
in a folder, a no-op that fetches no object (the server's request log), keys with CJK characters and spaces,
and every failure of the bucket as its one line; the CLI in a subprocess with the standard AWS environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from qdrant_client import QdrantClient

from conftest import REPO, settings_for
from kb_reindex.domain.errors import ConfigError, SourceError, classify
from kb_reindex.domain.planning import DocCounts
from kb_reindex.run.pipeline import RunResult, run_reindex
from kb_reindex.services.object_store import BucketAccess
from kb_reindex.services.runtime import Deps, open_source
from kb_reindex.services.sources import listing, load_corpus
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.store import KnowledgeStore
from kb_reindex.testing.s3_server import MotoS3Server

SECRET = "kb-test-secret-never-printed"
CJK_KEY = "售后 指南/退货 规则"
CJK_DOC = "# 退货规则\n\n签收后七天内可申请无理由退货，商品须保持完好。\n".encode()


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3Server]:
    with MotoS3Server(access_keys={"kb-test"}) as server:
        yield server


@pytest.fixture
def aws_env(s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The standard AWS environment the CLI's filesystem reads (one attempt: a dead endpoint fails at once)."""
    env = {**s3.env(secret=SECRET), "AWS_MAX_ATTEMPTS": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def new_bucket(s3: MotoS3Server, project: Path) -> str:
    """A bucket of the test's own holding the shipped documents under `docs/`, and one with CJK and spaces."""
    bucket = f"kb-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    for path in sorted((project / "knowledge" / "docs").glob("*.md")):
        client.put_object(Bucket=bucket, Key=f"docs/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key=f"docs/{CJK_KEY}.md", Body=CJK_DOC)
    client.put_object(Bucket=bucket, Key="docs/.drafts/wip.md", Body=b"# WIP\n\nnot yet\n")  # hidden, as .files are
    client.put_object(Bucket=bucket, Key="docs/notes.txt", Body=b"not markdown")
    return bucket


@pytest.fixture
def bucket_deps(s3: MotoS3Server, project: Path, aws_env: dict[str, str], tmp_path: Path) -> Iterator[Deps]:
    bucket = new_bucket(s3, project)
    settings = settings_for(project, KB_KNOWLEDGE_DIR=f"s3://{bucket}/docs/")
    state = StateStore(settings.state_url)
    client = QdrantClient(":memory:")
    yield Deps(settings=settings, state=state, store=KnowledgeStore(client))
    state.dispose()
    client.close()


def bucket_of(deps: Deps) -> str:
    return deps.settings.knowledge_source.removeprefix("s3://").split("/")[0]


def test_a_bucket_reindexes_like_a_folder_and_a_no_op_fetches_no_object(bucket_deps: Deps, s3: MotoS3Server) -> None:
    deps = bucket_deps
    bucket, client = bucket_of(deps), s3.client()
    assert deps.settings.knowledge_source == f"s3://{bucket}/docs"
    first = run_reindex(deps)
    assert first.outcome == "promoted", first.error
    live = deps.state.live_version("mall_knowledge")
    keys = set(deps.state.manifest_document_hashes(live.id))
    assert CJK_KEY in keys and "coupon-rules" in keys and len(keys) == 7, keys  # no hidden key, no .txt
    assert load_corpus(deps.knowledge)[0].knowledge_key == "after-sales-guide"

    # nothing changed: one listing, no object fetched (the ETags recorded need no mtime margin)
    s3.clear_requests()
    before = listing(deps.knowledge)
    quiet = run_reindex(deps)
    assert quiet.outcome == "no_change", quiet
    assert s3.object_gets() == [], s3.object_gets()
    listings = [r for r in s3.requests() if r.bucket == bucket]
    assert len(listings) == 2 and all(r.method == "GET" and "list-type=2" in r.query for r in listings), listings
    assert listing(deps.knowledge).digest == before.digest

    # edited to the same size within the same second: the ETag tells
    coupon = client.get_object(Bucket=bucket, Key="docs/coupon-rules.md")["Body"].read()
    edited = coupon.replace("。".encode(), "！".encode(), 1)
    assert len(edited) == len(coupon) and edited != coupon
    client.put_object(Bucket=bucket, Key="docs/coupon-rules.md", Body=edited)
    assert listing(deps.knowledge).digest != before.digest
    s3.clear_requests()
    changed = run_reindex(deps)
    assert changed.outcome == "promoted", changed.error
    assert changed.docs == DocCounts(added=0, changed=1, unchanged=6, removed=0)
    gets = [r.key for r in s3.object_gets()]
    assert "docs/coupon-rules.md" in gets and not any(".drafts" in key or key.endswith(".txt") for key in gets)

    client.put_object(Bucket=bucket, Key="docs/faq/积分 兑换.md", Body="# 积分兑换\n\n积分可兑换优惠券。\n".encode())
    added = run_reindex(deps)
    assert added.outcome == "promoted" and added.docs.added == 1, added

    client.delete_object(Bucket=bucket, Key=f"docs/{CJK_KEY}.md")
    removed = run_reindex(deps)
    assert removed.outcome == "promoted" and removed.docs.removed == 1, removed
    collection = deps.state.live_version("mall_knowledge").collection
    served = {p.payload["knowledge_key"] for p in deps.store.client.scroll(collection, limit=10_000)[0]}
    assert CJK_KEY not in served and "faq/积分 兑换" in served


def test_a_fed_edit_of_a_bucket_lists_no_prefix_and_fetches_the_named_object_alone(bucket_deps: Deps,
                                                                                      s3: MotoS3Server) -> None:
    """The watcher's change feed over a bucket: the plan asks the named objects alone (no listing of the
    prefix: tens of requests at 40k objects), and plans what a listing plans."""
    deps = bucket_deps
    bucket, client = bucket_of(deps), s3.client()
    assert run_reindex(deps).outcome == "promoted"
    coupon = client.get_object(Bucket=bucket, Key="docs/coupon-rules.md")["Body"].read()
    client.put_object(Bucket=bucket, Key="docs/coupon-rules.md", Body=coupon + "\n\n满减券不与折扣同享。\n".encode())
    client.delete_object(Bucket=bucket, Key=f"docs/{CJK_KEY}.md")
    s3.clear_requests()
    fed = run_reindex(deps, changed=("coupon-rules.md", f"{CJK_KEY}.md"))
    assert fed.outcome == "promoted", fed.error
    assert fed.docs == DocCounts(added=0, changed=1, unchanged=5, removed=1)
    listings = [r for r in s3.requests() if r.bucket == bucket and "list-type=2" in r.query]
    # s3fs asks a name that is gone whether it is a folder: one key at most, never the prefix's listing
    assert all("max-keys=1" in r.query for r in listings), listings
    assert {r.key for r in s3.object_gets()} == {"docs/coupon-rules.md"}, s3.object_gets()
    # what the plan recorded is what the watcher lists: its next look sees nothing to fire for
    from kb_reindex.run.follow import change_feed
    assert change_feed(deps.state, deps.settings, deps.knowledge, listing(deps.knowledge)) == ()
    assert run_reindex(deps).outcome == "no_change"  # a listing finds nothing the feed missed


def test_an_object_changed_after_the_plan_changes_nothing_of_the_build(bucket_deps: Deps, s3: MotoS3Server) -> None:
    """DAG-style: the plan's snapshot holds the texts; the build and validation send no request to the bucket."""
    from kb_reindex.steps.build import build, create_version
    from kb_reindex.steps.plan import prepare
    from kb_reindex.steps.promote import promote
    from kb_reindex.steps.snapshot import snapshot_plan
    from kb_reindex.steps.validate import validate

    deps, client = bucket_deps, s3.client()
    deps.state.start_run(run_id="dag-run", alias="mall_knowledge", kind="reindex", trigger="airflow")
    planned = snapshot_plan(deps, prepare(deps, record=True), run_id="dag-run")
    client.put_object(Bucket=bucket_of(deps), Key="docs/shipping-policy.md", Body="# 配送\n\n已改写。\n".encode())
    s3.clear_requests()
    created = create_version(deps, planned, run_id="dag-run")
    build(deps, created.version, run_id="dag-run")
    validate(deps, created.version)
    promote(deps, created.version, run_id="dag-run")
    assert s3.requests() == []
    texts = [p.payload["text"] for p in deps.store.client.scroll(created.collection, limit=10_000)[0]
             if p.payload["source"] == "shipping-policy.md"]
    assert texts and not any("已改写" in t for t in texts)


def test_every_failure_of_the_bucket_is_one_line_and_the_alias_stays(bucket_deps: Deps, s3: MotoS3Server,
                                                                    aws_env: dict[str, str], project: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    deps = bucket_deps
    bucket, client = bucket_of(deps), s3.client()
    assert run_reindex(deps).outcome == "promoted"
    live = deps.store.alias_target("mall_knowledge")

    def failed(**changes: object) -> RunResult:
        again = Deps(settings=replace(deps.settings, **changes), state=deps.state, store=deps.store)  # type: ignore[arg-type]
        result = run_reindex(again)
        assert result.outcome == "failed", result
        assert deps.store.alias_target("mall_knowledge") == live, "the alias stays"
        assert SECRET not in json.dumps(result.to_dict(), ensure_ascii=False, default=str)
        return result

    gone = failed(knowledge_source="s3://kb-no-such-bucket/docs")
    assert gone.error_kind == "config" and "\n" not in gone.error, gone
    assert "bucket kb-no-such-bucket does not exist at " + s3.url in gone.error

    client.create_bucket(Bucket=f"{bucket}-empty")
    empty = failed(knowledge_source=f"s3://{bucket}-empty/docs")
    assert f"knowledge source s3://{bucket}-empty/docs holds no .md documents" in empty.error, empty

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kb-wrong-key")
    refused = failed()
    assert refused.error_kind == "config" and "\n" not in refused.error, refused
    assert f"bucket {bucket} refused the credentials of the AWS environment" in refused.error
    assert "(InvalidAccessKeyId)" in refused.error and "kb-wrong-key" not in refused.error
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env["AWS_ACCESS_KEY_ID"])

    dead = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{dead}")
    unreachable = failed()
    assert unreachable.error_kind == "source_unreachable" and "\n" not in unreachable.error, unreachable
    assert (f"the S3 endpoint http://127.0.0.1:{dead} does not answer (connection refused); bucket {bucket} was not "
            "read") in unreachable.error
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)

    # an object that is not UTF-8, one over the size limit: the very lines a file gets
    folder = project / "bad-files"
    folder.mkdir()
    for name, data in (("latin1.md", "# Café\n\nrègle\n".encode("latin-1")), ("big.md", b"# Big\n\n" + b"x" * 400)):
        client.put_object(Bucket=bucket, Key=f"bad/{name}", Body=data)
        (folder / name).write_bytes(data)
    bad = failed(knowledge_source=f"s3://{bucket}/bad", max_doc_bytes=300)
    with pytest.raises(SourceError) as as_files:
        load_corpus(folder, max_bytes=300)
    assert bad.error == str(as_files.value), (bad.error, str(as_files.value))
    assert "latin1.md: not valid UTF-8 at byte" in bad.error and "big.md: file is 407 bytes, over the limit" \
        in bad.error


def test_source_uris_are_checked_and_a_registry_entry_names_its_aws_connection(tmp_path: Path) -> None:
    from kb_reindex.services.registry import load_registry

    assert settings_for(tmp_path, KB_KNOWLEDGE_DIR="s3://my-bucket").knowledge_source == "s3://my-bucket"
    for value, said in (("gs://b/docs", "a local folder or s3://bucket/prefix, not gs://"),
                        ("s3://AKIA:secret@b-1/docs", "holds credentials"),
                        ("s3://Bad_Bucket/docs", "is not an S3 bucket name")):
        with pytest.raises(ConfigError, match=said) as refused:
            settings_for(tmp_path, KB_KNOWLEDGE_DIR=value)
        assert "secret" not in str(refused.value)
    (tmp_path / "golden.yaml").write_text((REPO / "knowledge" / "golden.yaml").read_text(encoding="utf-8"),
                                          encoding="utf-8")
    (tmp_path / "registry.yaml").write_text(
        "knowledge_bases:\n  wiki:\n    source: s3://wiki-bucket/pages\n    golden_set: golden.yaml\n"
        "    aws_conn_id: aws_wiki\n  shop:\n    source: docs\n    golden_set: golden.yaml\n"
        "  odd:\n    source: ftp://host/docs\n    golden_set: golden.yaml\n", encoding="utf-8")
    registry = load_registry({"KB_REGISTRY": str(tmp_path / "registry.yaml"), "KB_PROJECT_ROOT": str(tmp_path)})
    wiki, shop = registry.get("wiki"), registry.get("shop")
    assert (wiki.aws_conn_id, wiki.settings().knowledge_source) == ("aws_wiki", "s3://wiki-bucket/pages")
    assert (shop.aws_conn_id, shop.settings().knowledge_source) == ("aws_default", str(tmp_path / "docs"))
    assert registry.errors == (f"{tmp_path / 'registry.yaml'}: knowledge base 'odd': source='ftp://host/docs': a "
                               "knowledge source is a local folder or s3://bucket/prefix, not ftp://",)


def test_the_cli_reads_a_bucket_with_the_aws_environment(s3: MotoS3Server, project: Path) -> None:
    """`kb-reindex run` as a user runs it: a subprocess, the bucket named by KB_KNOWLEDGE_DIR, credentials and
    endpoint in the standard AWS variables; then a no-op fetching no object, and a wrong key's exit 2."""
    bucket = new_bucket(s3, project)
    env = {name: value for name, value in os.environ.items() if not name.startswith(("KB_", "AWS_"))}
    env.update(s3.env(secret=SECRET), KB_PROJECT_ROOT=str(project), KB_EMBEDDER="hashing",
               KB_KNOWLEDGE_DIR=f"s3://{bucket}/docs", AWS_MAX_ATTEMPTS="1")
    cli = [str(Path(sys.executable).parent / "kb-reindex")]

    def run(*argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *argv], env={**env, **extra}, capture_output=True, text=True, timeout=180)

    first = run("run", "--json", "-q")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout)["outcome"] == "promoted"
    s3.clear_requests()
    quiet = run("run", "--json", "-q")
    assert quiet.returncode == 0 and json.loads(quiet.stdout)["outcome"] == "no_change", quiet.stderr[-3000:]
    assert s3.object_gets() == []
    refused = run("run", AWS_ACCESS_KEY_ID="kb-wrong-key")
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if bucket in line]
    assert len(lines) == 1 and "refused the credentials" in lines[0] and "InvalidAccessKeyId" in lines[0], refused.stderr
    assert SECRET not in refused.stderr + refused.stdout
    dead = run("plan", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")
    assert dead.returncode == 3 and "does not answer (connection refused)" in dead.stderr, dead.stderr
    assert SECRET not in dead.stderr + dead.stdout


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_open_source_hands_a_task_filesystem_down(s3: MotoS3Server, project: Path) -> None:
    """The Airflow side gives a ready filesystem (ObjectStoragePath's); a refusal then names its Connection."""
    import s3fs

    bucket = new_bucket(s3, project)
    settings = settings_for(project, KB_KNOWLEDGE_DIR=f"s3://{bucket}/docs")
    fs = s3fs.S3FileSystem(endpoint_url=s3.url, key="kb-wrong-key", secret=SECRET, skip_instance_cache=True)
    knowledge = open_source(settings, BucketAccess(lambda uri: fs, "the Airflow Connection aws_kb"))
    with pytest.raises(ConfigError) as refused:
        listing(knowledge)
    assert classify(refused.value).exit_code == 2
    assert str(refused.value) == (f"knowledge source s3://{bucket}/docs: bucket {bucket} refused the credentials of the "
                                  "Airflow Connection aws_kb (InvalidAccessKeyId); check the key and its permission "
                                  "to list and read the bucket")


def test_a_task_refuses_an_aws_connection_its_registry_entry_names_and_airflow_lacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kb_reindex.airflow import connections
    from kb_reindex.services.registry import load_registry

    (tmp_path / "golden.yaml").write_text((REPO / "knowledge" / "golden.yaml").read_text(encoding="utf-8"),
                                          encoding="utf-8")
    (tmp_path / "registry.yaml").write_text("knowledge_bases:\n  wiki:\n    source: s3://wiki-bucket/pages\n"
                                            "    golden_set: golden.yaml\n    aws_conn_id: aws_wiki\n", encoding="utf-8")
    wiki = load_registry({"KB_REGISTRY": str(tmp_path / "registry.yaml"), "KB_PROJECT_ROOT": str(tmp_path)}).get("wiki")
    monkeypatch.setattr(connections, "_connection", lambda conn_id: None)  # Airflow has no such Connection
    access = connections.object_storage(wiki)
    assert access.credentials == "the Airflow Connection aws_wiki"
    with pytest.raises(ConfigError, match=r"knowledge base 'wiki' names the Connection 'aws_wiki', which Airflow "
                                          r"does not have"):
        access.filesystem("s3://wiki-bucket/pages")
