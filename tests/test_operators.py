"""What operators hit (issue #21): each as the operator meets it, mostly in separate processes with the real
environment variables set, the way the CLI, a DAG task or the assistant runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kb_reindex.embedding import HashingEmbedder
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer

CLI = Path(sys.executable).with_name("kb-reindex")
ALIAS = "mall_knowledge"


def kb_env(project: Path, **extra: str) -> dict[str, str]:
    """The child's real environment: what a shell exporting these variables gives the command."""
    return {**os.environ, "KB_PROJECT_ROOT": str(project), "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **extra}


def kb(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def two_ollamas() -> Iterator[tuple[FakeOllamaServer, FakeOllamaServer]]:
    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    model = FakeModel(name="bge-m3", dim=1024, embed=lambda _m, text: embedder.embed_one(text))
    with FakeOllamaServer([model]) as a, FakeOllamaServer([model]) as b:
        yield a, b


# --- 1. a multi-server OLLAMA_HOST in the real environment ----------------------------------------

#: the reader module as the assistant uses it, in a process of its own
READER = """
import json
from kb_reindex.config import Settings
from kb_reindex.reader import search_knowledge
from kb_reindex.runtime import open_reader
with open_reader(Settings.from_env()) as reader:
    print(json.dumps({"n": len(search_knowledge(reader, "运费怎么算", k=2)["results"])}))
"""

#: a DAG run's tasks, called as Airflow's worker calls them (no Connections defined: the environment)
DAG_TASKS = """
import json
from kb_reindex import airflow_tasks as t
run = "airflow__knowledge_reindex__multi-host"
plan = t.plan_task(run_id=run, force_full=True)
version = t.create_version_task(plan=plan, run_id=run)
built = t.build_task(version=version, run_id=run)
print(json.dumps({"version": version["version"], "built": built}, default=str))
"""


def test_a_multi_server_ollama_host_in_the_environment_works_for_every_entry_point(
        project: Path, two_ollamas: tuple[FakeOllamaServer, FakeOllamaServer]) -> None:
    """`import ollama` builds a default client from OLLAMA_HOST and could not parse a list: every command
    that embeds failed with `Port could not be cast to integer value`."""
    a, b = two_ollamas
    env = kb_env(project, OLLAMA_HOST=f"{a.url},{b.url}", KB_EMBED_BATCH_SIZE="8")
    first = kb(env, "run", "--json")  # the offline default builds v1; the migration to Ollama follows
    assert first.returncode == 0, first.stderr[-3000:]
    dry = kb(env, "migrate", "--embedder", "ollama", "--model", "bge-m3", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    env["KB_EMBEDDER"] = "ollama"
    done = kb(env, "migrate", "--embedder", "ollama", "--model", "bge-m3", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["outcome"] == "promoted"
    assert a.embedded_texts > 0 and b.embedded_texts > 0, "both servers of the list served the build"
    found = kb(env, "query", "运费怎么算", "--json")
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout)["results"]
    reader = subprocess.run([sys.executable, "-c", READER], env=env, capture_output=True, text=True, timeout=120)
    assert reader.returncode == 0, reader.stderr[-3000:]
    assert json.loads(reader.stdout)["n"] == 2
    tasks = subprocess.run([sys.executable, "-c", DAG_TASKS], env=env, capture_output=True, text=True, timeout=180)
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    assert json.loads(tasks.stdout.strip().splitlines()[-1])["version"] == 3
    for output in (dry, done, found, reader, tasks):
        assert "could not be cast" not in output.stderr
