from __future__ import annotations

from pathlib import Path

import pytest

from kb_reindex.errors import GoldenSetError
from kb_reindex.golden import check_probe_keys, first_hit_rank, load_golden_set, score

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "golden.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_golden_set_covers_every_document() -> None:
    golden = load_golden_set(REPO / "knowledge" / "golden.yaml")
    keys = {p.stem for p in (REPO / "knowledge" / "docs").glob("*.md")}
    assert len(golden.probes) >= 24
    assert {e for p in golden.probes for e in p.expected} == keys
    check_probe_keys(golden, keys)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k: 0\nprobes: [{id: a, query: q, expected: [x]}]", "'k' must be a whole number of at least 1"),
        ("k: 2\nmin_hit_rate: 1.5\nprobes: [{id: a, query: q, expected: [x]}]", "'min_hit_rate' must be a number from 0 to 1"),
        ("min_mrr: -0.1\nprobes: [{id: a, query: q, expected: [x]}]", "'min_mrr'"),
        ("max_regressions: -1\nprobes: [{id: a, query: q, expected: [x]}]", "'max_regressions'"),
        ("k: 2\nprobes: []", "'probes' must be a non-empty list"),
        ("probes: [{id: a, expected: [x]}]", "probe 'a': 'query' must be non-empty text"),
        ("probes: [{id: a, query: q}]", "probe 'a': 'expected' must be a non-empty list"),
        ("probes: [{query: q, expected: [x]}]", "probes[0]: 'id'"),
        ("probes: [{id: a, query: q, expected: [x]}, {id: a, query: r, expected: [x]}]", "id is used twice"),
        ("k: [unclosed", "not valid YAML"),
    ],
)
def test_malformed_golden_set_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(GoldenSetError) as error:
        load_golden_set(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_probe_naming_a_missing_key_is_reported_with_its_id(tmp_path: Path) -> None:
    golden = load_golden_set(write(tmp_path, "probes: [{id: ghost, query: q, expected: [nowhere]}, {id: ok, query: q, expected: [a]}]"))
    with pytest.raises(GoldenSetError, match="ghost -> nowhere"):
        check_probe_keys(golden, {"a"})


def test_rank_and_scores() -> None:
    assert first_hit_rank(["a", "b", "c"], ["c"]) == 3
    assert first_hit_rank(["a", "b"], ["z"]) is None
    hit_rate, mrr = score([1, 2, None, 4])
    assert hit_rate == 0.75
    assert mrr == pytest.approx((1 + 0.5 + 0.25) / 4)
    assert score([]) == (0.0, 0.0)
