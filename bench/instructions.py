"""The instruction detector (kb_reindex.domain.instructions) on its labelled set, bench/instructions.yaml:
precision and recall on the lines the patterns were written against, on the lines written after (held out,
never tuned on), and in all; and its false positives on the shipped knowledge pages (the goal: 0).

    .venv/bin/python bench/instructions.py        # prints the table; writes bench/results/instructions.{json,md}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "include"))

from kb_reindex.domain.instructions import flag_instructions, is_instruction  # noqa: E402
from kb_reindex.services.sources import read_document  # noqa: E402


def scores(instructions: list[str], policy: list[str]) -> dict[str, float | int]:
    found = sum(map(is_instruction, instructions))
    false = sum(map(is_instruction, policy))
    return {"instruction_lines": len(instructions), "policy_lines": len(policy), "found": found,
            "false_positives": false, "recall": round(found / len(instructions), 3),
            "precision": round(found / (found + false), 3) if found + false else 1.0}


def measure() -> dict[str, object]:
    data = yaml.safe_load((HERE / "instructions.yaml").read_text(encoding="utf-8"))
    shipped = []
    for docs in sorted((HERE.parent / "knowledge").rglob("docs")):
        for path in sorted(docs.rglob("*.md")):
            document = read_document(path, docs, max_bytes=2_000_000)
            shipped += [f"{path.relative_to(HERE.parent)}:{n}: {t}"
                        for n, t in flag_instructions(document.body, first_line=document.body_line)]
    return {"tuned": scores(data["instruction"], data["policy"]),
            "held_out": scores(data["held_out_instruction"], data["held_out_policy"]),
            "all": scores(data["instruction"] + data["held_out_instruction"], data["policy"] + data["held_out_policy"]),
            "missed_held_out": [line for line in data["held_out_instruction"] if not is_instruction(line)],
            "shipped_false_positives": shipped}


def main() -> None:
    result = measure()
    rows = [f"| {name} | {s['instruction_lines']} / {s['policy_lines']} | {s['recall']} | {s['precision']} |"  # type: ignore[index]
            for name, s in (("tuned on", result["tuned"]), ("held out", result["held_out"]), ("all", result["all"]))]
    table = "\n".join(["| lines | instruction / policy | recall | precision |", "|---|---|---|---|", *rows,
                       f"\nshipped pages: {len(result['shipped_false_positives'])} false positive(s)"])  # type: ignore[arg-type]
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "instructions.json").write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (out / "instructions.md").write_text(table + "\n", encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
