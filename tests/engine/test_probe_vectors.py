"""Validation embeds only the golden probes it has not embedded before under the version's profile: counted at
our Ollama server, a second run after a one-line edit embeds that edit's chunks and no probe."""

from __future__ import annotations

from pathlib import Path

from conftest import PATTERNS_SCREEN, settings_for
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.services.embedding import HashingEmbedder
from kb_reindex.services.runtime import open_deps
from kb_reindex.steps.golden import load_golden_set
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer


def test_a_second_validation_embeds_only_new_probes(project: Path) -> None:
    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    model = FakeModel("bge-m3", 1024, embed=lambda _m, text: embedder.embed_one(text))
    golden_path = project / "knowledge" / "golden.yaml"
    probes = len(load_golden_set(golden_path).probes)
    with FakeOllamaServer([model]) as ollama:
        settings = settings_for(project, KB_EMBEDDER="ollama", KB_EMBED_MODEL="bge-m3", KB_EMBED_DIM="1024",
                                OLLAMA_HOST=ollama.url, **PATTERNS_SCREEN)
        with open_deps(settings) as deps:
            first = run_reindex(deps)
            assert first.outcome == "promoted", first.error
            assert ollama.embedded_texts == first.chunks.embedded + probes

            page = project / "knowledge" / "docs" / "coupon-rules.md"
            page.write_text(page.read_text(encoding="utf-8") + "\n\n补充：节假日不适用。\n", encoding="utf-8")
            ollama.reset_counters()
            second = run_reindex(deps)
            assert second.outcome == "promoted", second.error
            assert second.chunks.embedded >= 1
            assert ollama.embedded_texts == second.chunks.embedded, "no probe embedded again"

            # a probe added to the golden set (beside another edit) is the one probe embedded
            page = project / "knowledge" / "docs" / "payment-guide.md"
            page.write_text(page.read_text(encoding="utf-8") + "\n\n补充：支持先用后付。\n", encoding="utf-8")
            text = golden_path.read_text(encoding="utf-8")
            golden_path.write_text(text.replace("probes:\n", "probes:\n  - id: added-probe\n    query: 优惠券可以叠加使用吗\n"
                                                "    expected: [coupon-rules]\n", 1), encoding="utf-8")
            ollama.reset_counters()
            again = run_reindex(deps)
            assert again.outcome == "promoted", again.error
            assert ollama.embedded_texts == again.chunks.embedded + 1
