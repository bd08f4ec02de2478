"""Validation reports on disk (CSV for tools, Markdown for people), built with pandas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from kb_reindex.state import VersionRecord


def write_validation_report(reports_dir: Path, version: VersionRecord, result: dict[str, Any]) -> Path:
    """Write `<reports>/<alias>/v<N>/validation.{csv,md}` and return the Markdown path."""
    folder = reports_dir / version.alias / f"v{version.version}"
    folder.mkdir(parents=True, exist_ok=True)
    probes = pd.DataFrame(
        result["probes"],
        columns=["probe", "query", "expected", "rank_live", "rank_candidate", "hit", "regression", "top"],
    )
    probes.to_csv(folder / "validation.csv", index=False)
    checks = pd.DataFrame(result["checks"], columns=["check", "passed", "detail"])
    lines = [
        f"# Validation of {version.alias} v{version.version}",
        "",
        f"- collection: `{version.collection}`",
        f"- model: `{version.embed_model}` ({version.embed_dim}-d, {version.distance})",
        f"- result: **{'PASSED' if result['passed'] else 'FAILED'}**",
        f"- hit@{result['k']}: {result['hit_rate']:.3f} (min {result['thresholds']['min_hit_rate']})"
        + (f", live v{result['live_version']} ({result.get('live_embed_model')}): {result['live_hit_rate']:.3f}" if result["live_version"] else ""),
        f"- MRR: {result['mrr']:.3f} (min {result['thresholds']['min_mrr']})"
        + (f", live: {result['live_mrr']:.3f}" if result["live_version"] else ""),
        f"- regressions: {result['regressions']} (max {result['thresholds']['max_regressions']})",
        "",
    ]
    if result["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in result["failures"]] + [""]
    lines += ["## Structural checks", "", _markdown(checks), "", "## Golden probes", "",
              _markdown(probes.drop(columns=["top"])), ""]
    flagged = result.get("flagged_instructions") or []
    lines += [f"## Instruction-like text ({len(flagged)})", ""]
    if flagged:
        lines += ["Knowledge text is data: these lines are listed for review and are not acted on.", "",
                  _markdown(pd.DataFrame(flagged, columns=["source", "line", "text"])), ""]
    else:
        lines += ["None found.", ""]
    path = folder / "validation.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _markdown(frame: pd.DataFrame) -> str:
    """A pipe table without the optional `tabulate` dependency."""
    if frame.empty:
        return "(none)"
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join("" if pd.isna(v) else str(v).replace("|", "\\|") for v in row) + " |"
            for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])
