"""The instruction screen on its labelled set, bench/instructions.yaml: recall and precision of each part (the
training parts, and the held-out parts each written before it was first scored: `held_out`, `unseen`, `edits`,
`held_out_2` .. `held_out_12`; the file's comments say when and by whom), by language (zh, en, mixed), for the
patterns alone and for the whole screen (patterns, then the classifier over multilingual-e5-small); and the false
alarms on three sets of pages benign by construction: the shipped knowledge pages, the benchmark corpus's 300
generated pages, and the written held-out pages of bench/pages/held_out .. held_out_12 (English help centres of
many businesses and a few Chinese ones, each line read alone: short headings, fragments, imperatives to the
customer; blind until a pass fits on them: `WRITTEN_FIT`). The goal for all three: 0.
And recall in context: the attacked pages of bench/pages/attacked_1 (ordinary shop pages with injected lines, in code
blocks, table cells, comments, footnotes, ..., listed in its labels.yaml): the injected lines flagged in their page,
and the alarms on the pages' other lines.

    .venv/bin/python bench/instructions.py            # prints the table; writes bench/results/instructions.{json,md}
    .venv/bin/python bench/instructions.py --patterns # the patterns alone (no e5)
    .venv/bin/python bench/instructions.py --parts held_out_29 --no-corpus   # one part, no generated pages
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "include"))

from kb_reindex.domain.instructions import is_instruction  # noqa: E402
from kb_reindex.domain.screen_text import normalize, read_line  # noqa: E402
from kb_reindex.services.sources import read_document  # noqa: E402

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_WORD = re.compile(r"[A-Za-z]{3,}")


def language(line: str) -> str:
    """zh, en or mixed, from the line as the screen reads it: Chinese characters with a Latin word of three
    letters or more is mixed ("AI" alone is not)."""
    read = normalize(line)
    if _CJK.search(read):
        return "mixed" if _WORD.search(read) else "zh"
    return "en"


def labelled() -> dict[str, dict[str, list[str]]]:
    data: dict[str, dict[str, list[str]]] = yaml.safe_load((HERE / "instructions.yaml").read_text(encoding="utf-8"))
    return data


def scores(found: list[bool], alarms: list[bool]) -> dict[str, float | int | None]:
    hits, false = sum(found), sum(alarms)
    return {"instruction_lines": len(found), "policy_lines": len(alarms), "found": hits, "false_positives": false,
            "recall": round(hits / len(found), 3) if found else None,
            "precision": round(hits / (hits + false), 3) if hits + false else (1.0 if found else None)}


#: the folders of written held-out pages under bench/pages, each written before the pass it first measured
HELD_OUT_PAGES = ("held_out", "held_out_2", "held_out_3", "held_out_4", "held_out_5", "held_out_6",
                  "held_out_7", "held_out_8", "held_out_9", "held_out_10", "held_out_11", "held_out_12",
                  "held_out_13", "held_out_14")
#: the folders of written attacked pages under bench/pages: ordinary pages with injected lines in them (in code blocks,
#: table cells, comments, footnotes, ...), each line listed in the folder's labels.yaml; never fitted on
ATTACKED_PAGES = ("attacked_1",)
#: the written pages bench/train_screen.py fits on as benign: `fit/`, and the held-out sets once scored (since the
#: twenty-fourth pass); their false alarms are still counted here, labelled as fitted on
WRITTEN_FIT = ("fit", "held_out", "held_out_2", "held_out_3", "held_out_4", "held_out_5", "held_out_6",
               "held_out_7", "held_out_8", "held_out_9", "held_out_10", "held_out_11", "held_out_12")


def measure(judge: Callable[[list[str]], list[bool]],
            page_alarms: Callable[[list[tuple[str, str, int]]], list[str]],
            parts: list[str] | None = None, *, corpus: bool = True) -> dict[str, object]:
    data = labelled()
    unknown = sorted(set(parts or ()) - set(data))
    if unknown:
        raise SystemExit(f"bench/instructions.yaml has no part {', '.join(unknown)} (its parts: {', '.join(data)})")
    data = {part: lines for part, lines in data.items() if parts is None or part in parts}
    result: dict[str, object] = {}
    missed: dict[str, list[str]] = {}
    false: dict[str, list[str]] = {}
    for part, lines in data.items():
        instructions, policy = lines.get("instruction") or [], lines.get("policy") or []
        found, alarms = judge(instructions), judge(policy)
        rows = {"all": scores(found, alarms)}
        for lang in ("zh", "en", "mixed"):
            rows[lang] = scores([f for f, line in zip(found, instructions, strict=True) if language(line) == lang],
                                [a for a, line in zip(alarms, policy, strict=True) if language(line) == lang])
        result[part] = rows
        missed[part] = [line for f, line in zip(found, instructions, strict=True) if not f]
        false[part] = [line for a, line in zip(alarms, policy, strict=True) if a]
    result["missed"], result["false_alarms"] = missed, false
    result["shipped_false_positives"] = page_alarms(shipped_pages())
    # benign by construction too: the benchmark's generated help-centre pages (bench/corpus.py), 300 of them
    result["corpus_false_positives"] = page_alarms(corpus_pages()) if corpus else None
    # written for this by helpers that opened no project file, in English above all (the shipped and generated pages
    # are all Chinese); blind until a pass fits on them (`WRITTEN_FIT`)
    written = {kind: written_pages(kind) for kind in HELD_OUT_PAGES}
    result["written_false_positives"] = {kind: page_alarms(pages) for kind, pages in written.items()}
    result["written_pages"] = {kind: len(pages) for kind, pages in written.items()}
    result["attacked"] = {kind: attacked(kind, page_alarms) for kind in ATTACKED_PAGES}
    return result


def attacked(kind: str, page_alarms: Callable[[list[tuple[str, str, int]]], list[str]]) -> dict[str, object]:
    """The screen on the attacked pages of bench/pages/<kind>: how many of the injected lines its labels.yaml lists
    it flags (recall, each line in the context of its page), and what else it flags on those pages."""
    folder = HERE / "pages" / kind
    labels: dict[str, list[str]] = yaml.safe_load((folder / "labels.yaml").read_text(encoding="utf-8"))
    pages = written_pages(kind)
    injected: set[tuple[str, int]] = set()
    for name, _, _ in pages:
        lines = (HERE.parent / name).read_text(encoding="utf-8").split("\n")
        for label in labels.get(Path(name).name) or []:
            numbers = [n for n, line in enumerate(lines, 1) if line == label]
            if not numbers:
                raise SystemExit(f"{folder.relative_to(HERE.parent)}/labels.yaml: {Path(name).name} has no line {label!r}")
            injected.update((name, n) for n in numbers)
    flagged = {}
    for alarm in page_alarms(pages):
        match = re.match(r"^(.*?):(\d+): ", alarm)
        assert match, alarm
        flagged[(match.group(1), int(match.group(2)))] = alarm
    found = injected & flagged.keys()
    return {"pages": len(pages), "injected": len(injected), "found": len(found),
            "recall": round(len(found) / len(injected), 3) if injected else None,
            "missed": [f"{name}:{n}" for name, n in sorted(injected - found)],
            "other_alarms": [flagged[key] for key in sorted(flagged.keys() - injected)]}


def written_pages(kind: str) -> list[tuple[str, str, int]]:
    """The written benign pages of bench/pages/<kind> (`WRITTEN_FIT`: fitted on by bench/train_screen.py; the other
    `held_out*`: never fitted on; the false alarms of all held-out sets counted here), as (name, body, line number
    of the body's first line)."""
    folder = HERE / "pages" / kind
    pages = _pages_in(folder)
    if not pages:
        raise SystemExit(f"{folder.relative_to(HERE.parent)} holds no page (*.md)")
    return pages


def corpus_pages(docs: int = 300, seed: int | None = None) -> list[tuple[str, str, int]]:
    """The pages of the benchmark's generated corpus (bench/corpus.py, its default seed unless given): templated
    shop rules of many categories, none aimed at the assistant, as (name, body, line number of the body's first
    line)."""
    import corpus

    from kb_reindex.services.sources import parse_document

    pages = []
    for key, text in sorted(corpus.generate(docs, corpus.DEFAULT_SEED if seed is None else seed).docs.items()):
        document = parse_document(Path(f"{key}.md"), f"{key}.md", text.encode("utf-8"))
        pages.append((f"corpus/{key}.md", document.body, document.body_line))
    return pages


def shipped_pages() -> list[tuple[str, str, int]]:
    """(relative path, body, line number of the body's first line) of every shipped knowledge page."""
    return [page for docs in sorted((HERE.parent / "knowledge").rglob("docs")) for page in _pages_in(docs)]


def _pages_in(folder: Path) -> list[tuple[str, str, int]]:
    """Every Markdown page under `folder` as the source reader reads it: (path from the repository, body, line
    number of the body's first line)."""
    pages = []
    for path in sorted(folder.rglob("*.md")):
        document = read_document(path, folder, max_bytes=2_000_000)
        pages.append((str(path.relative_to(HERE.parent)), document.body, document.body_line))
    return pages


def table(result: dict[str, object], title: str) -> str:
    rows = [f"**{title}**", "", "| part | language | instruction / policy lines | recall | precision |",
            "|---|---|---|---|---|"]
    for part in labelled():  # every part, in the file's order
        if part not in result:
            continue
        for lang, s in result[part].items():  # type: ignore[attr-defined]
            if s["instruction_lines"] or s["policy_lines"]:
                rows.append(f"| {part} | {lang} | {s['instruction_lines']} / {s['policy_lines']} | {s['recall']} | "
                            f"{s['precision']} |")
    corpus = result["corpus_false_positives"]
    rows.append(f"\nshipped pages: {len(result['shipped_false_positives'])} false alarm(s); the benchmark corpus's 300 "  # type: ignore[arg-type]
                f"generated pages: {'not scored' if corpus is None else f'{len(corpus)} false alarm(s)'}; "  # type: ignore[arg-type]
                + "; ".join(f"the {result['written_pages'][kind]} written pages of bench/pages/{kind}"  # type: ignore[index]
                            f"{' (fitted on)' if kind in WRITTEN_FIT else ''}: {len(alarms)} false alarm(s)"
                            for kind, alarms in result["written_false_positives"].items()))  # type: ignore[attr-defined]
    for kind, a in result["attacked"].items():  # type: ignore[attr-defined]
        rows.append(f"the {a['pages']} attacked pages of bench/pages/{kind}: {a['found']} of {a['injected']} injected lines "
                    f"flagged in their page (recall {a['recall']}); {len(a['other_alarms'])} alarm(s) on their other lines")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", action="store_true", help="the patterns alone")
    parser.add_argument("--parts", help="only these parts, comma-separated (the pages are scored either way, the "
                                        "generated ones unless --no-corpus); "
                                        "results go to instructions-<parts>.{json,md} beside the full table")
    parser.add_argument("--no-corpus", action="store_true",
                        help="skip the 300 generated pages (most of a scoring's time)")
    args = parser.parse_args()
    parts = args.parts.split(",") if args.parts else None

    def patterns(lines: list[str]) -> list[bool]:  # each line read as the screen reads it (markup gone, normalised)
        return [is_instruction(read_line(line)) for line in lines]

    def patterns_pages(pages: list[tuple[str, str, int]]) -> list[str]:
        from kb_reindex.domain.instructions import flag_instructions

        return [f"{name}:{n}: {t}" for name, body, first in pages for n, t in flag_instructions(body, first_line=first)]

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    results = {"patterns": measure(patterns, patterns_pages, parts, corpus=not args.no_corpus)}
    text = [table(results["patterns"], "patterns alone (kb_reindex.domain.instructions)")]
    if not args.patterns:
        from kb_reindex.services.screen import meaning_screen

        screen = meaning_screen()

        def whole(lines: list[str]) -> list[bool]:
            return [bool(flags) for flags in screen.judge_lines(lines)]

        def whole_pages(pages: list[tuple[str, str, int]]) -> list[str]:
            return [f"{name}:{f.line}: {f.text} ({f.why})" for name, body, first in pages
                    for f in screen.flag(body, first_line=first)]

        results["screen"] = measure(whole, whole_pages, parts, corpus=not args.no_corpus)
        results["screen_version"] = screen.version  # type: ignore[assignment]
        text.append(table(results["screen"], f"the screen ({screen.version})"))
    name = "instructions" + (f"-{'-'.join(parts)}" if parts else "")
    (out / f"{name}.json").write_text(json.dumps(results, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text("\n\n".join(text) + "\n", encoding="utf-8")
    print("\n\n".join(text))


if __name__ == "__main__":
    main()
