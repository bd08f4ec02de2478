"""Two knowledge bases reindexed at once, as two `kb-reindex --kb ... run` processes against one Qdrant server
(our Qdrant-protocol test server as a process) and one Ollama server (our test server, a per-text cost): each
holds its own lock, so both promote, neither waits for the other (KB_LOCK_WAIT=0 would refuse a waiter at
once), and the Ollama server sees both embedding at the same moment. Runs of the same knowledge base still
serialize: a second run of one of them is refused while the first holds its lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import PATTERNS_SCREEN, REPO
from kb_reindex.services.embedding import HashingEmbedder
from kb_reindex.services.state.store import StateStore
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer, FaultPlan
from kb_reindex.testing.qdrant_server import start_process

CLI = Path(sys.executable).with_name("kb-reindex")
SHOP, SELLER = "mall_knowledge", "seller_rules"


def test_two_knowledge_bases_build_at_the_same_time_and_both_promote(tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    qdrant = start_process(tmp_path / "qdrant-server")
    # lexical vectors (the golden sets pass), 40 ms per text, one request in flight per process; the first
    # request waits (up to 90 s) for a second to arrive, so two processes that start seconds apart on a loaded
    # machine still meet, and two builds that were serialized never do
    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    model = FakeModel("bge-m3", 1024, embed=lambda _m, text: embedder.embed_one(text))
    faults = FaultPlan(delay_per_text_s=0.04, company=2, company_wait_s=90)
    with FakeOllamaServer([model], faults=faults) as ollama:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
        env.update(KB_PROJECT_ROOT=str(project), KB_REGISTRY="knowledge/registry.yaml", KB_QDRANT_URL=qdrant.url,
                   KB_EMBEDDER="ollama", KB_EMBED_MODEL="bge-m3", OLLAMA_HOST=ollama.url, KB_LOCK_WAIT="0",
                   KB_EMBED_BATCH_SIZE="4", **PATTERNS_SCREEN)
        try:
            procs = {kb: subprocess.Popen([str(CLI), "--kb", kb, "run", "--json", "-q"], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) for kb in (SHOP, SELLER)}
            answers = {kb: proc.communicate(timeout=300) for kb, proc in procs.items()}
        finally:
            qdrant.stop()
        overlapping = ollama.max_in_flight
    for kb, (out, err) in answers.items():
        assert procs[kb].returncode == 0, (kb, out, err)
        assert json.loads(out)["outcome"] == "promoted", (kb, out)
    assert overlapping == 2, "the two builds never embedded at the same moment"
    state = StateStore(f"sqlite:///{project / '.kb' / 'state.db'}", create=False)
    try:
        shop, seller = (state.list_runs(kb, limit=1)[0] for kb in (SHOP, SELLER))
    finally:
        state.dispose()
    overlap_s = (min(shop.finished_at, seller.finished_at) - max(shop.started_at, seller.started_at)).total_seconds()
    assert overlap_s > 0, (shop, seller)
    print(f"two knowledge bases at once: runs {shop.duration_s:.1f} s and {seller.duration_s:.1f} s, "
          f"overlapping {overlap_s:.1f} s")


def test_runs_of_one_knowledge_base_still_serialize(tmp_path: Path) -> None:
    kb = SELLER
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
    env.update(KB_PROJECT_ROOT=str(project), KB_REGISTRY="knowledge/registry.yaml", KB_EMBEDDER="hashing",
               KB_LOCK_WAIT="0")
    url = f"sqlite:///{project / '.kb' / 'state.db'}"
    code = ("import sys, time\n"
            "from kb_reindex.services.state.store import StateStore\n"
            "from kb_reindex.services.state.locks import default_lock_owner\n"
            f"s = StateStore({url!r})\n"
            f"s.acquire_lock('reindex:{kb}', owner=default_lock_owner('cli__reindex__other'), ttl_s=3600)\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n")
    (project / ".kb").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = subprocess.run([str(CLI), "--kb", kb, "run", "--json", "-q"], env=env, capture_output=True,
                                 text=True, timeout=120)
        assert refused.returncode != 0 and f"another run is working on {kb}" in json.loads(refused.stdout)["error"]
        other = subprocess.run([str(CLI), "--kb", SHOP, "run", "--json", "-q"], env=env, capture_output=True,
                               text=True, timeout=120)
        assert json.loads(other.stdout)["outcome"] == "promoted", other.stdout + other.stderr
    finally:
        holder.kill()
        holder.wait()
