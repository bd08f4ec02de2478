"""`kb-reindex`: the same steps as the DAGs, for when Airflow is down or for a quick look.

Exit codes: 0 success or no change, 1 a failed run, 2 a usage or configuration error.
Human tables by default; `--json` prints one JSON object on stdout (logs go to stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kb_reindex.config import Settings
from kb_reindex.errors import ConfigError, KbError

log = logging.getLogger("kb_reindex.cli")


def _parser() -> argparse.ArgumentParser:
    def common_flags(default: Any) -> argparse.ArgumentParser:
        flags = argparse.ArgumentParser(add_help=False)
        flags.add_argument("--json", action="store_true", default=default, help="print one JSON object instead of tables")
        flags.add_argument("-q", "--quiet", action="store_true", default=default, help="only warnings and errors on stderr")
        return flags

    # accepted before or after the command (`kb-reindex -q plan`, `kb-reindex plan -q`); the command's
    # copy has no default, so it never resets what was given before the command
    common = common_flags(argparse.SUPPRESS)
    parser = argparse.ArgumentParser(prog="kb-reindex", description=__doc__.splitlines()[0],
                                     parents=[common_flags(False)])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", parents=[common], help="plan, build, validate and promote a new version")
    run.add_argument("--force-full", action="store_true", help="embed every chunk; reuse no vector")
    run.add_argument("--dry-run", action="store_true", help="plan only and say what would happen")
    sub.add_parser("plan", parents=[common], help="what a run would do, writing nothing")
    sub.add_parser("status", parents=[common], help="live version, all versions, drift and metrics")
    sub.add_parser("history", parents=[common], help="every alias move")
    val = sub.add_parser("validate", parents=[common], help="validate a version (default: live) again")
    val.add_argument("--version", type=int, help="version number")
    query = sub.add_parser("query", parents=[common], help="search the live version through the alias")
    query.add_argument("text")
    query.add_argument("-k", type=int, default=4)
    query.add_argument("--tenant", help="only this tenant's documents")
    sub.add_parser("gc", parents=[common], help="apply retention: drop failed and old retired versions")
    rb = sub.add_parser("rollback", parents=[common], help="point the alias back at a previous version")
    rb.add_argument("--to-version", type=int, help="default: the version before the current one")
    rb.add_argument("--reason", required=True, help="why (recorded in the alias history)")
    rb.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    rb.add_argument("--no-revalidate", action="store_true", help="skip the golden-set scores of the target")
    mig = sub.add_parser("migrate", parents=[common], help="full build with another embedding model")
    mig.add_argument("--embedder", required=True, choices=["hashing", "ollama"])
    mig.add_argument("--model", help="default: the embedder's own (hashing-ngram-v1, bge-m3)")
    mig.add_argument("--dim", type=int, help="vector size (default: probed from the embedder)")
    mig.add_argument("--no-promote", action="store_true", help="build and validate only (a shadow version)")
    mig.add_argument("--min-hit-rate", type=float)
    mig.add_argument("--min-mrr", type=float)
    sub.add_parser("reconcile", parents=[common], help="record what the alias serves when state disagrees")
    drop = sub.add_parser("drop", parents=[common], help="drop a kept version (e.g. a shadow migration)")
    drop.add_argument("--version", type=int, required=True)
    return parser


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    import pandas as pd

    if not rows:
        return "(none)"
    frame = pd.DataFrame(rows, columns=columns).astype(object).where(lambda f: f.notna(), "-")
    return frame.to_string(index=False)


def _print(args: argparse.Namespace, data: dict[str, Any], human: str) -> None:
    if args.json:
        print(json.dumps(data, ensure_ascii=False, default=str, indent=2))
    else:
        print(human)


def _run_human(r: dict[str, Any]) -> str:
    d, c = r["docs"], r["chunks"]
    lines = [
        f"outcome: {r['outcome']}" + (f"  version: v{r['version']}  collection: {r['collection']}" if r.get("version") else ""),
        f"docs: +{d['added']} added, ~{d['changed']} changed, ={d['unchanged']} unchanged, -{d['removed']} removed",
        f"chunks: {c['total']} total, {c['embedded']} embedded, {c['reused']} reused",
    ]
    if r.get("validation"):
        v = r["validation"]
        lines.append(f"validation: {'passed' if v['passed'] else 'FAILED'}  hit rate {v['hit_rate']}  MRR {v['mrr']}  "
                     f"regressions {v['regressions']}" + (f"  report {v['report']}" if v.get("report") else ""))
    if r.get("error"):
        lines.append(f"error: {r['error']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    try:
        return _dispatch(args)
    except ConfigError as exc:
        _fail(args, str(exc), "config")
        return 2
    except KbError as exc:
        _fail(args, str(exc), type(exc).__name__)
        return 1
    except Exception as exc:  # noqa: BLE001 - the CLI must answer in its own format, with the traceback logged
        log.exception("kb_reindex: unexpected error")
        _fail(args, f"{type(exc).__name__}: {exc}", "unexpected")
        return 1


def _fail(args: argparse.Namespace, message: str, kind: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"outcome": "failed", "error": message, "error_kind": kind}, ensure_ascii=False))
    print(f"kb-reindex: error: {message}", file=sys.stderr)


def _dispatch(args: argparse.Namespace) -> int:
    from kb_reindex import engine
    from kb_reindex.runtime import open_deps

    settings = Settings.from_env()
    with open_deps(settings) as deps:
        if args.command == "run":
            result = engine.run_reindex(deps, force_full=args.force_full, dry_run=args.dry_run)
            result.pop("plan", None)
            _print(args, result, _run_human(result))
            return 1 if result["outcome"] == "failed" else 0
        if args.command == "migrate":
            from kb_reindex.config import model_or_default
            from kb_reindex.embedding import check_model_served

            model = model_or_default(args.embedder, args.model)
            # a model the embedder cannot serve is a usage error (exit 2), refused before a run is recorded
            check_model_served(settings, embedder=args.embedder, model=model)
            result = engine.run_reindex(
                deps, kind="migration", embedder=args.embedder, model=model, dim=args.dim,
                promote_version=not args.no_promote, min_hit_rate=args.min_hit_rate, min_mrr=args.min_mrr,
            )
            result.pop("plan", None)
            _print(args, result, _run_human(result))
            return 1 if result["outcome"] == "failed" else 0
        if args.command == "plan":
            from kb_reindex.plan import plan

            p = plan(deps)
            human = _run_human({**engine.empty_result("no_change" if p["no_change"] else "would_build"),
                                "docs": p["docs"], "chunks": p["chunks"]})
            _print(args, p, human + f"\nmodel: {p['embedder']}/{p['embed_model']}  live: v{p['base_version'] or '-'}")
            return 0
        if args.command == "status":
            s = engine.status(deps)
            live = s["live"]
            head = f"alias {s['alias']} -> " + (f"v{live['version']} ({live['collection']}, {live['points']} points, "
                                                f"{live['embed_model']} {live['dim']}-d)" if live else "nothing")
            rows = [{**v, "status": v["status"] + (" *rollback target" if v["rollback_target"] else "")} for v in s["versions"]]
            human = "\n".join([head, "", _table(rows, ["version", "status", "collection", "points", "embed_model", "dim",
                                                        "hit_rate", "mrr", "created_at"])]
                              + [f"PROBLEM: {p}" for p in s["problems"]])
            _print(args, s, human)
            return 1 if s["problems"] else 0
        if args.command == "history":
            events = engine.history(deps)
            _print(args, {"alias": settings.alias, "events": events},
                   _table(events, ["at", "action", "from_version", "to_version", "run_id", "reason"]))
            return 0
        if args.command == "validate":
            from kb_reindex.validate import validate

            number = args.version
            if number is None:
                live = deps.state.live_version(settings.alias)
                if live is None:
                    raise ConfigError("no live version; name one with --version")
                number = live.version
            result = validate(deps, number, raise_on_failure=False)
            summary = engine.validation_summary(result)
            _print(args, {"version": number, **summary, "checks": result["checks"]},
                   f"v{number}: {'passed' if result['passed'] else 'FAILED'}  hit rate {result['hit_rate']}  "
                   f"MRR {result['mrr']}  report {result['report']}"
                   + "".join(f"\n  failure: {f}" for f in result["failures"]))
            return 0 if result["passed"] else 1
        if args.command == "query":
            from kb_reindex.reader import search_knowledge

            found = search_knowledge(deps, args.text, k=args.k, tenant=args.tenant)
            rows = [{**r, "text": (r["text"] or "").replace("\n", " ")[:60]} for r in found["results"]]
            _print(args, found, _table(rows, ["score", "knowledge_key", "title", "text"]))
            return 0
        if args.command == "gc":
            from kb_reindex.promote import cleanup

            result = cleanup(deps)
            _print(args, result, _table(result["deleted"], ["version", "collection", "was"]))
            return 0
        if args.command == "rollback":
            return _rollback(args, deps)
        if args.command == "drop":
            from kb_reindex.promote import drop_version

            result = drop_version(deps, args.version)
            _print(args, result, f"dropped v{result['version']} ({result['collection']}, was {result['was']})")
            return 0
        if args.command == "reconcile":
            from kb_reindex.reconcile import reconcile

            result = reconcile(deps)
            _print(args, result, result["message"])
            return 0
    raise ConfigError(f"unknown command {args.command}")  # pragma: no cover - argparse rejects it first


def _rollback(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex import engine
    from kb_reindex.promote import rollback_target

    live = deps.state.live_version(deps.settings.alias)
    target = deps.state.get_version(deps.settings.alias, args.to_version) if args.to_version else rollback_target(deps)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError("rollback needs confirmation: pass --yes when not running in a terminal")
        print(f"alias {deps.settings.alias}: v{live.version if live else '-'} -> "
              f"v{target.version if target else '?'} ({target.collection if target else 'no target'})")
        if input("Switch the alias? Type 'yes': ").strip().lower() != "yes":
            print("nothing changed")
            return 1
    result = engine.run_rollback(deps, reason=args.reason, to_version=args.to_version,
                                 revalidate=not args.no_revalidate)
    _print(args, result, f"rolled back: v{result['from_version']} -> v{result['to_version']} ({result['collection']})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
