"""`kb-reindex`: the same steps as the DAGs, for when Airflow is down or for a quick look.

Exit codes: 0 success or no change, 1 a failed run (or a version held for a person), 2 a usage or configuration
error, 3 a server it needs (Qdrant, the state DB, Ollama) unavailable.
Human tables by default; `--json` prints one JSON object on stdout (logs go to stderr).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from kb_reindex.domain.embedders import DEFAULT_MODELS, EMBEDDERS

#: `typing.TYPE_CHECKING` without importing typing (which brings contextlib, collections.abc and more): the CLI
#: answers --help and usage errors before it imports anything but argparse; the rest (the stores, the model,
#: Airflow, and even the package's errors, settings, logging and json) where a command needs it
TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    from collections.abc import Sequence
    from typing import Any, NoReturn

    from kb_reindex.domain.errors import Failure
    from kb_reindex.rules.freeze import FreezeView
    from kb_reindex.run.status import StatusView
    from kb_reindex.services.config import Settings
    from kb_reindex.services.registry import KnowledgeBase, Registry


def _log() -> logging.Logger:
    import logging

    return logging.getLogger("kb_reindex.cli")


#: commands that never create a state DB or a local Qdrant folder: they only read
NO_CREATE = frozenset({"status", "plan", "query"})
#: commands that need only the state DB (never Qdrant, which a stuck process may hold in local mode); `retire`
#: opens Qdrant itself, and only to drop
STATE_ONLY = frozenset({"history", "unlock", "freeze", "unfreeze", "retire", "keep-live"})
#: commands that, with several knowledge bases registered and none named, show all of them
ALL_BASES = frozenset({"status", "bases"})
#: on-call's commands: they act on an entry that no longer loads (refused, or removed from the registry) from its
#: last entry that loaded, recorded in the state DB, or its alias alone (kb_reindex.run.bases.on_call_base)
ON_CALL = frozenset({"status", "history", "rollback", "freeze", "unfreeze", "unlock"})
#: commands whose settings leave out a mistake in a setting they do not read (`Settings.for_on_call`): on-call's,
#: and the listing of what serves
ON_CALL_SETTINGS = ON_CALL | {"bases"}
#: commands that record the entry they ran with in the state DB (what ON_CALL acts from once it no longer loads)
RECORDS_ENTRY = frozenset({"run", "migrate", "validate", "gc", "promote", "reconcile"})
#: commands that change state or the alias take the alias's lock here; run and migrate take it inside the
#: engine, as their DAG tasks do; rollback takes none (only the short alias lock of the move)
LOCKED = frozenset({"validate", "gc", "drop", "reconcile", "promote", "pin", "unpin", "restore"})


class _Parser(argparse.ArgumentParser):
    """argparse, except that with `--json` a usage error is answered as JSON on stdout too (still exit 2)."""

    def __init__(self, *args: Any, json_answer: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.json_answer = json_answer

    def error(self, message: str) -> NoReturn:
        if self.json_answer:
            import json

            print(json.dumps({"outcome": "failed", "error": f"{self.prog}: {message}", "error_kind": "usage"},
                             ensure_ascii=False))
        super().error(message)


def _parser(*, json_answer: bool = False) -> argparse.ArgumentParser:
    def common_flags(default: Any) -> argparse.ArgumentParser:
        flags = argparse.ArgumentParser(add_help=False)
        flags.add_argument("--json", action="store_true", default=default, help="print one JSON object instead of tables")
        flags.add_argument("-q", "--quiet", action="store_true", default=default, help="only warnings and errors on stderr")
        flags.add_argument("-v", "--verbose", action="store_true", default=default,
                           help="also the HTTP requests to Qdrant and Ollama on stderr")
        flags.add_argument("--kb", metavar="ALIAS", default=None if default is False else default,
                           help="the knowledge base of KB_REGISTRY to act on (default: KB_NAME, or the only one)")
        return flags

    # accepted before or after the command (`kb-reindex -q plan`, `kb-reindex plan -q`); the command's
    # copy has no default, so it never resets what was given before the command
    common = common_flags(argparse.SUPPRESS)
    parser = _Parser(prog="kb-reindex", description=__doc__.splitlines()[0], parents=[common_flags(False)],
                     json_answer=json_answer)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                # argparse only calls parser_class(...): a partial that binds json_answer works
                                parser_class=functools.partial(_Parser, json_answer=json_answer))  # type: ignore[call-overload]

    run = sub.add_parser("run", parents=[common], help="plan, build, validate and promote a new version")
    run.add_argument("--force-full", action="store_true", help="embed every chunk; reuse no vector")
    run.add_argument("--dry-run", action="store_true", help="plan only and say what would happen")
    run.add_argument("--layout", help="change the payload layout (default: live's, whatever KB_PAYLOAD_LAYOUT says): "
                                      "native, langchain4j[:<text key>], langchain, llamaindex; vectors are copied")
    run.add_argument("--watch", type=float, metavar="MINUTES",
                     help="after a promotion, watch the alias this long and roll back on a regression "
                          "(default KB_WATCH_MINUTES, 0: off)")
    run.add_argument("--changed", nargs="+", action="extend", metavar="NAME",
                     help="the documents changed since the last run, named as under the knowledge folder or prefix "
                          "(e.g. from a git hook): only they are looked at, the others taken as the last plan "
                          "recorded them; a run without it lists the source")
    run.add_argument("--follow", action="store_true",
                     help="stay in the foreground: run now if the source changed since the last plan, then once per "
                          "change (listed every KB_SOURCE_POLL_S, quiet for KB_SOURCE_QUIET_S); Ctrl-C ends it")
    run.set_defaults(func=_cmd_run)
    sub.add_parser("plan", parents=[common], help="what a run would do, writing nothing").set_defaults(func=_cmd_plan)
    sub.add_parser("bases", parents=[common], help="every knowledge base: what serves, model, freeze, last run")
    sub.add_parser("status", parents=[common], help="live version, all versions, drift and metrics").set_defaults(
        func=_cmd_status)
    sub.add_parser("history", parents=[common], help="every alias move").set_defaults(func=_cmd_history)
    val = sub.add_parser("validate", parents=[common], help="validate a version (default: live) again")
    val.add_argument("--version", type=int, help="version number")
    val.set_defaults(func=_cmd_validate)
    query = sub.add_parser("query", parents=[common], help="search the live version through the alias "
                                                            "(or, with --version N, that version's collection)")
    query.add_argument("text")
    query.add_argument("-k", type=int, default=4)
    query.add_argument("--tenant", help="only this tenant's documents")
    query.add_argument("--version", type=int, metavar="N",
                       help="try version N (any status but deleted: a candidate, a shadow, a retired one) by "
                            "searching its collection directly, not through the alias")
    query.add_argument("--expect-profile", help="refuse unless the alias serves this embedding profile")
    query.set_defaults(func=_cmd_query)
    sub.add_parser("gc", parents=[common], help="apply retention: drop failed and old retired versions").set_defaults(
        func=_cmd_gc)
    rb = sub.add_parser("rollback", parents=[common], help="point the alias back at a previous version")
    rb.add_argument("--to-version", type=int, help="default: the version before the current one")
    rb.add_argument("--reason", required=True, help="why (recorded in the alias history)")
    rb.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    rb.add_argument("--live-version", type=int, metavar="N",
                    help="the version you saw serving (scripts): refused, nothing moved, if another serves "
                         "(default: the one serving when the command starts, shown in the prompt)")
    rb.add_argument("--no-revalidate", action="store_true", help="skip the golden-set scores of the target")
    rb.add_argument("--freeze", action="store_true",
                    help="freeze the alias first: no later run, migration or shadow promotion moves it forward "
                         "until `kb-reindex unfreeze` (the bad change is usually still in the knowledge folder)")
    rb.set_defaults(func=_rollback)
    mig = sub.add_parser("migrate", parents=[common], help="full build with another embedding model")
    mig.add_argument("--embedder", required=True, choices=list(EMBEDDERS))
    mig.add_argument("--model", help="default: the embedder's own ("
                                     + ", ".join(f"{kind}: {name}" for kind, name in DEFAULT_MODELS.items()) + ")")
    mig.add_argument("--dim", type=int, help="vector size (default: probed from the embedder)")
    mig.add_argument("--no-promote", action="store_true", help="build and validate only (a shadow version)")
    mig.add_argument("--min-hit-rate", type=float)
    mig.add_argument("--min-mrr", type=float)
    mig.add_argument("--layout", help="payload layout of the new version (default: live's): native, "
                                      "langchain4j[:<text key>], langchain, llamaindex")
    mig.add_argument("--dry-run", action="store_true",
                     help="texts, estimated tokens and time (one probe batch) before anything is built; writes nothing")
    mig.set_defaults(func=_cmd_migrate)
    prom = sub.add_parser("promote", parents=[common],
                          help="put a shadow version behind the alias, after validating it again")
    prom.add_argument("--version", type=int, required=True)
    prom.add_argument("--reason", help="why it goes live now (a held version: what you checked); kept in the history")
    prom.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    prom.add_argument("--live-version", type=int, metavar="N",
                      help="the version you saw serving (scripts): refused, nothing moved, if another serves "
                           "(default: the one serving when the command starts, shown in the prompt)")
    prom.set_defaults(func=_cmd_promote)
    keep = sub.add_parser("keep-live", parents=[common],
                          help="the other answer to a held version: do not promote it (recorded on it, with why)")
    keep.add_argument("--version", type=int, required=True)
    keep.add_argument("--reason", required=True, help="why it does not go live (kept on the version)")
    keep.set_defaults(func=_cmd_keep_live)
    _add_operator_commands(sub, common)
    return parser


def _add_operator_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """on-call's commands on one alias: reconcile, unlock, freeze, drop, pins."""
    rec = sub.add_parser("reconcile", parents=[common], help="record what the alias serves when state disagrees")
    rec.add_argument("--rebuild-state", action="store_true",
                     help="rebuild a lost, empty or replaced state DB from the collections in Qdrant")
    rec.add_argument("--replace", action="store_true",
                     help="with --rebuild-state: replace the versions the state DB holds for this alias")
    rec.set_defaults(func=_cmd_reconcile)
    unlock = sub.add_parser("unlock", parents=[common], help="break this alias's lock (on-call; recorded)")
    unlock.add_argument("--reason", required=True, help="why (recorded in the history)")
    unlock.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    unlock.set_defaults(func=_unlock)
    frz = sub.add_parser("freeze", parents=[common],
                         help="hold every promotion of this alias (runs still build); rollbacks still run")
    frz.add_argument("--reason", required=True, help="why (shown with the freeze and kept in the history)")
    frz.set_defaults(func=_cmd_freeze)
    sub.add_parser("unfreeze", parents=[common], help="lift the freeze: promotions move the alias again").set_defaults(
        func=_cmd_unfreeze)
    drop = sub.add_parser("drop", parents=[common], help="drop a kept version (e.g. a shadow migration)")
    drop.add_argument("--version", type=int, required=True)
    drop.set_defaults(func=_cmd_drop)
    restore = sub.add_parser("restore", parents=[common],
                             help="bring a kept version that resides in no slot back into one (embeds nothing)")
    restore.add_argument("--version", type=int, required=True)
    restore.set_defaults(func=_cmd_restore)
    retire = sub.add_parser("retire", parents=[common],
                            help="take this knowledge base out of service: end its reindexing (a build in progress is "
                                 "fenced), record who, when and why; nothing builds, promotes or rolls it back after")
    retire.add_argument("--reason", help="why (recorded with who and when); required unless --undo")
    retire.add_argument("--drop-collections", action="store_true",
                        help="also delete the alias and drop every collection of it (every version, slot and vault); "
                             "without it both are kept and the assistant keeps reading what was live")
    retire.add_argument("--undo", action="store_true",
                        help="end the retirement: it is built, promoted and rolled back again (dropped collections "
                             "are not brought back: the next run builds one from scratch)")
    retire.add_argument("--yes", action="store_true", help="with --drop-collections: do not ask for confirmation")
    retire.set_defaults(func=_cmd_retire)
    pin = sub.add_parser("pin", parents=[common], help="keep a version (a known-good baseline) from retention and drop")
    pin.add_argument("--version", type=int, required=True)
    pin.add_argument("--reason", required=True, help="why it is kept (recorded with who and when)")
    pin.set_defaults(func=_cmd_pin)
    unpin = sub.add_parser("unpin", parents=[common], help="end a pin; retention may drop the version again")
    unpin.add_argument("--version", type=int, required=True)
    unpin.set_defaults(func=_cmd_unpin)


#: what a table cell shows of a control character that would break its line (as pandas' to_string does)
_CELL_ESCAPES = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Each value as it is, None as `-`, every column right-aligned to its widest cell and one space apart: the
    layout of pandas' `DataFrame.to_string(index=False)`, which it replaces here because importing pandas was a
    sixth of `bases` and `status` (0.24 s of 1.4 s, bench/README.md)."""
    if not rows:
        return "(none)"
    cells = [["-" if row.get(name) is None else str(row.get(name)).translate(_CELL_ESCAPES) for name in columns]
             for row in rows]
    widths = [max([len(name), *(len(line[i]) for line in cells)]) for i, name in enumerate(columns)]
    return "\n".join(" ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
                     for line in [columns, *cells])


def _print(args: argparse.Namespace, data: dict[str, Any], human: str) -> None:
    import json

    if args.json:
        print(json.dumps(data, ensure_ascii=False, default=str, indent=2))
    else:
        print(human)


def _doc_keys(r: dict[str, Any]) -> dict[str, list[str]]:
    """The documents a run or plan removed, added and changed, by knowledge key (the plan names the first ones)."""
    keys = (r.get("plan") or {}).get("doc_keys") or r.get("doc_keys") or {}
    return {kind: list(keys.get(kind) or []) for kind in ("removed", "added", "changed")}


def _run_human(r: dict[str, Any]) -> str:
    from kb_reindex.domain.validation_model import NO_GOLDEN_SET

    d, c = r["docs"], r["chunks"]
    lines = [
        f"outcome: {r['outcome']}" + (f"  version: v{r['version']}  collection: {r['collection']}" if r.get("version") else ""),
        f"docs: +{d['added']} added, ~{d['changed']} changed, ={d['unchanged']} unchanged, -{d['removed']} removed",
        *(f"  {kind}: {', '.join(keys)}" for kind, keys in _doc_keys(r).items() if keys),
        f"chunks: {c['total']} total; this run: {c['embedded']} embedded, {c['copied']} copied, "
        f"{c['skipped']} skipped (already written); planned: {c['planned_embed']} to embed, {c['planned_reuse']} to reuse",
    ]
    if r.get("validation"):
        v = r["validation"]
        scores = "no golden probes scored" if v["hit_rate"] is None else f"hit rate {v['hit_rate']}  MRR {v['mrr']}"
        lines.append(f"validation: {'passed' if v['passed'] else 'FAILED'}  {scores}  regressions {v['regressions']}"
                     + (f"  report {v['report']}" if v.get("report") else ""))
    lines += [f"WARNING: {w['text']}" for w in r.get("warnings") or () if w.get("kind") == NO_GOLDEN_SET]
    if (r.get("validation") or {}).get("replay"):
        rp = r["validation"]["replay"]
        lines.append(f"replay: skipped ({rp['skipped']})" if "skipped" in rp else
                     f"replay: {rp['queries']} logged queries, mean overlap {rp['mean_overlap']}, empty "
                     f"{rp['empty_live']} live -> {rp['empty_candidate']}, {rp['lost_top_hits']} lost top hit(s)")
    if r.get("watch"):
        w = r["watch"]
        lines.append(f"watch: {w['outcome']}" + (f" ({len(w['checks'])} checks)" if w.get("checks") else "")
                     + (f" -> v{w['to_version']}" if w.get("to_version") else "")
                     + (f": {'; '.join(w['signals'])}" if w.get("signals") else "")
                     + (f": {w['reason']}" if w["outcome"] == "alias_moved" else "")
                     + (f"; {w['error']}" if w.get("error") else ""))
    if r.get("frozen"):
        lines.append(f"FROZEN: {r['frozen']['message']}")
    if r.get("held"):
        lines.append(f"HELD: v{r['version']} is not promoted: {'; '.join(r['held']['reasons'])}. Look at what went, "
                     f"then `kb-reindex promote --version {r['version']} --reason \"...\"` puts it live")
    for note in r.get("notes") or []:
        lines.append(f"note: {note}")
    if r.get("error"):
        lines.append(f"error: {r['error']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 success or no change, 1 a failed run or a held version, 2 a usage or configuration error, 3 a
    server unavailable."""
    try:
        code = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        # `kb-reindex history | head -1`: the reader has gone; nothing left to say to it. Python would
        # flush stdout again at exit and fail again, so it is pointed at devnull (as the Python docs advise).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    try:
        args = _parser(json_answer="--json" in argv).parse_args(argv)
    except SystemExit as stop:  # a usage error (2) or --help (0), already answered by argparse
        return stop.code if isinstance(stop.code, int) else 2
    import gc
    import logging

    # a command is one short process that holds many rows at once (a manifest's, a plan's) and makes few reference
    # cycles: the collector's default thresholds walked those rows again and again (a steady edit at 50k chunks:
    # 0.44 s in 748 collections of a 3.5 s run). Cycles are still collected, rarely (bench/README P15, 2026-12-05)
    gc.set_threshold(50_000, 20, 100)

    level, fmt = logging.WARNING if args.quiet else logging.INFO, "%(asctime)s %(levelname)s %(message)s"
    from kb_reindex.run.terminal import use_terminal_log

    # a terminal gets a progress bar for builds and restores; --json, -q and a pipe get the plain lines
    if args.json or args.quiet or not use_terminal_log(sys.stderr, level=level, fmt=fmt):
        logging.basicConfig(level=level, stream=sys.stderr, format=fmt)
    if not args.verbose:  # the HTTP clients' request lines (Qdrant's, Ollama's) only when asked for
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return _dispatch(args)
    except BrokenPipeError:
        raise
    except Exception as exc:  # the CLI answers in its own format; a traceback only for a bug
        failure = _failure(exc, args)
        if not failure.expected:
            _log().exception("kb_reindex: unexpected error")
        _fail(args, failure.message, failure.kind)
        return failure.exit_code


def _failure(exc: BaseException, args: argparse.Namespace) -> Failure:
    """errors.classify, naming the state DB and Qdrant of the chosen knowledge base's settings (when they parse)."""
    from kb_reindex.domain.errors import KbError, classify
    from kb_reindex.services.registry import select_knowledge_base
    from kb_reindex.services.store import describe_qdrant_failure

    try:
        settings: Settings | None = select_knowledge_base(getattr(args, "kb", None)).settings()
    except KbError:
        settings = None
    if settings is None:
        return classify(exc)
    return classify(exc, state_url=settings.state_url, qdrant=lambda e: describe_qdrant_failure(e, settings))


def _fail(args: argparse.Namespace, message: str, kind: str) -> None:
    import json

    if getattr(args, "json", False):
        print(json.dumps({"outcome": "failed", "error": message, "error_kind": kind}, ensure_ascii=False))
    print(f"kb-reindex: error: {message}", file=sys.stderr)


def _dispatch(args: argparse.Namespace) -> int:
    """Open what the command needs (see NO_CREATE, STATE_ONLY, LOCKED), then call its `func`."""
    from kb_reindex.services.registry import load_registry, named_in

    registry = load_registry()
    for warning in registry.warnings:
        _log().warning("kb_reindex: %s", warning)
    if args.command == "bases" and not (args.kb or named_in()) and registry.path is not None:
        from kb_reindex.services.config import state_url_from_env

        return _print_bases(args, registry, state_url_from_env())  # every entry, a lone broken one too
    if args.command in ALL_BASES and not (args.kb or named_in()) and registry.path is not None:
        from kb_reindex.run.bases import removed_entries
        from kb_reindex.services.config import state_url_from_env

        # a knowledge base removed from the registry but never retired still serves: it is listed too
        removed = removed_entries(registry, state_url_from_env())
        if registry.entries > 1 or removed:
            return _all_bases(args, registry, removed)
    if args.command in ON_CALL or args.command == "retire":
        from kb_reindex.run.bases import on_call_base
        from kb_reindex.services.config import state_url_from_env

        # a retired knowledge base is refused (who retired it, when, how to undo), except by `retire` itself
        kb = on_call_base(registry, args.kb, state_url_from_env(), retired=args.command == "retire")
    else:
        kb = registry.select(args.kb)
        if args.command != "bases" and not (args.command == "query" and args.version is None):
            from kb_reindex.run.bases import refuse_retired

            # the reader's path (`query` through the alias) needs no state DB, and a retired alias may still serve
            refuse_retired(registry, kb, kb.settings().state_url)
    args.registry_error = kb.problem
    # the registry file that still lists this knowledge base's entry (loaded or refused), if any
    args.listed_in = registry.path if registry.path is not None and kb.alias in registry.order else None
    if kb.problem:
        _log().warning("kb_reindex: %s; acting on %s from %s", kb.problem, kb.alias,
                       f"its entry as it last loaded ({kb.recorded_at})" if kb.recorded_at
                       else "its alias alone (no entry of it was recorded)")
    for refused in registry.errors:  # another entry's mistake never stops on-call acting on this one
        if refused != kb.problem:
            _log().warning("kb_reindex: %s (that knowledge base has only on-call's DAG until it is fixed)", refused)
    settings = kb.settings(on_call=args.command in ON_CALL_SETTINGS)
    for problem in settings.ignored_problems:
        _log().warning("kb_reindex: %s", problem)
    if args.command == "bases":
        return _print_bases(args, registry, settings.state_url)
    if args.command == "query" and args.version is None:
        # Qdrant alone: the assistant's path keeps answering while the state DB is lost, locked or down
        return args.func(args, settings)
    if args.command in STATE_ONLY:
        from kb_reindex.services.runtime import StateDeps
        from kb_reindex.services.state.store import StateStore

        # the state DB alone: on-call can break a lock while the stuck process still holds Qdrant (local mode)
        state = StateStore(settings.state_url, create=False)
        try:
            return args.func(args, StateDeps(settings=settings, state=state))
        finally:
            state.dispose()
    dry_migration = args.command == "migrate" and args.dry_run
    if args.command == "plan":
        return _plan_with_state(args, settings)
    if args.command == "run" and args.follow:
        return _follow(args, settings)
    from kb_reindex.services.runtime import open_deps

    with open_deps(settings, create=args.command not in NO_CREATE and not dry_migration) as deps:
        if args.command in RECORDS_ENTRY and kb.registered and kb.problem is None and not dry_migration:
            deps.state.record_entry(kb.recorded())
        if args.command == "promote" and not _confirm_promotion(args, deps):
            return 0
        if args.command in LOCKED:
            from kb_reindex.run.runs import exclusive

            with exclusive(deps):
                return args.func(args, deps)
        return args.func(args, deps)


# --- one function per command: (args, deps) -> exit code -----------------------------------------


def _cmd_query(args: argparse.Namespace, settings_or_deps: Any) -> int:
    """Through the alias it takes the settings, not deps, and opens Qdrant alone; `--version N` (deps: the state
    DB names the version) searches that version's collection (`steps.tryout.search_version`)."""
    from kb_reindex.domain.errors import ConfigError

    if args.version is not None:
        from kb_reindex.services.layouts import version_profile
        from kb_reindex.steps.tryout import search_version

        deps = settings_or_deps
        if args.expect_profile is not None:
            record = deps.state.get_version(deps.settings.alias, args.version)
            if record is not None and version_profile(record) != args.expect_profile:
                raise ConfigError(f"--expect-profile {args.expect_profile}: v{args.version} holds embedding profile "
                                  f"{version_profile(record)}")
        tried = search_version(deps, args.version, args.text, k=args.k, tenant=args.tenant)
        answer = tried.to_dict()
        head = (f"v{tried.version} ({tried.status}{', serving' if tried.serving else ', not serving'}, "
                f"{tried.collection}){f' tenant {tried.tenant}' if tried.tenant else ''}:\n")
    else:
        from kb_reindex.reader import search_knowledge
        from kb_reindex.services.runtime import open_reader

        with open_reader(settings_or_deps) as reader:
            found = search_knowledge(reader, args.text, k=args.k, tenant=args.tenant,
                                     expect_profile=args.expect_profile)
        answer, head = found.to_dict(), ""
    rows = [{**r, "text": (r["text"] or "").replace("\n", " ")[:60]} for r in answer["results"]]
    _print(args, answer, head + _table(rows, ["score", "knowledge_key", "title", "text"]))
    return 0


def _cmd_history(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.run.status import history
    events = [e.to_dict() for e in history(deps)]
    _print(args, {"alias": deps.settings.alias, "events": events},
           _table(events, ["at", "action", "from_version", "to_version", "by", "run_id", "reason"]))
    return 0


def _cmd_run(args: argparse.Namespace, deps: Any, changed: tuple[str, ...] | None = None) -> int:
    """`changed`: `--follow`'s change feed of its last look (else `--changed`, when given)."""
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.domain.model import RunOutcome, WatchOutcome
    from kb_reindex.run.pipeline import run_reindex

    settings = deps.settings
    minutes = settings.watch_minutes if args.watch is None else args.watch
    if not 0 <= minutes <= 24 * 60:
        raise ConfigError(f"--watch {args.watch}: minutes must be from 0 (off) to 1440")
    if changed is None and args.changed:
        changed = tuple(args.changed)
    result = run_reindex(deps, force_full=args.force_full, dry_run=args.dry_run, layout=args.layout,
                         changed=changed).to_dict()
    result.pop("plan", None)
    if result["outcome"] == RunOutcome.PROMOTED and minutes > 0:
        from kb_reindex.run.watch import watch

        watched = watch(deps, result["version"], minutes=minutes, interval_s=settings.watch_interval_s)
        result["watch"] = watched.to_dict()
        if watched.outcome in (WatchOutcome.ROLLED_BACK, WatchOutcome.REGRESSED):
            result["outcome"] = "auto_rolled_back" if watched.outcome == WatchOutcome.ROLLED_BACK else "regressed"
    _print(args, result, _run_human(result))
    return _run_exit_code(result)


def _follow(args: argparse.Namespace, settings: Settings) -> int:
    """`run --follow`: the state DB stays open for the looks; Qdrant (a local-mode folder is one process's at a
    time) only while a run builds. Each run prints its answer as `run` does; a failed run is said and the
    following goes on, waiting for the next change. Ctrl-C ends it (exit 130); a run it interrupts releases its
    lock as it unwinds, and its unfinished version is taken over by the next run."""
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.run.follow import follow
    from kb_reindex.services.runtime import open_deps
    from kb_reindex.services.state.store import StateStore

    if args.dry_run:
        raise ConfigError("--follow runs each change for real; --dry-run goes without it")
    if args.changed:
        raise ConfigError("--follow finds what changed at each look; --changed names one run's changes")
    state = StateStore(settings.state_url)

    def run_once(changed: tuple[str, ...] | None) -> None:
        from kb_reindex.domain.errors import KbError

        try:
            with open_deps(settings, state=state) as deps:
                code = _cmd_run(args, deps, changed)
        except KbError as exc:  # e.g. Qdrant down: said as a one-off command says it; the next change retries
            failure = _failure(exc, args)
            _fail(args, failure.message, failure.kind)
            code = failure.exit_code
        sys.stdout.flush()
        if code:
            _log().warning("kb_reindex: that run ended with exit code %d; following on", code)

    try:
        follow(settings, state, run_once)
    except KeyboardInterrupt:
        print("kb-reindex: stopped following", file=sys.stderr)
        return 130
    finally:
        state.dispose()
    return 0


def _cmd_migrate(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.services.config import model_or_default
    from kb_reindex.services.embedding import check_model_served

    model = model_or_default(args.embedder, args.model)
    # a model the embedder cannot serve is a usage error (exit 2), refused before a run is recorded
    check_model_served(deps.settings, embedder=args.embedder, model=model)
    if args.dry_run:
        from kb_reindex.steps.estimate import estimate_human, estimate_migration

        estimate = estimate_migration(deps, embedder=args.embedder, model=model, dim=args.dim)
        _print(args, estimate.to_dict(), estimate_human(estimate))
        return 0
    result = run_reindex(
        deps, kind="migration", embedder=args.embedder, model=model, dim=args.dim,
        promote_version=not args.no_promote, min_hit_rate=args.min_hit_rate, min_mrr=args.min_mrr,
        layout=args.layout,
    ).to_dict()
    result.pop("plan", None)
    _print(args, result, _run_human(result))
    return _run_exit_code(result)


def _plan_with_state(args: argparse.Namespace, settings: Settings) -> int:
    """`plan` on the state DB; on one that holds no kb-reindex state yet (a new MariaDB database), the
    preview of a first run, planned against an empty state in memory: nothing is created or written."""
    from kb_reindex.domain.errors import StateEmpty, StateMissing
    from kb_reindex.services.runtime import open_deps
    from kb_reindex.services.state.store import StateStore

    client = None
    missing: StateMissing | None = None
    try:
        state = StateStore(settings.state_url, create=False)
    except StateEmpty as empty:
        _log().warning("kb_reindex: %s. Previewing a first run", empty)
        state = StateStore("sqlite:///:memory:")
    except StateMissing as exc:  # a knowledge base never built: what its first run would do, warnings included
        missing = exc
        state = StateStore("sqlite:///:memory:")
        if settings.qdrant_path is not None and not (settings.qdrant_path / "meta.json").is_file():
            from kb_reindex.services.qdrant import QdrantClient

            client = QdrantClient(location=":memory:")  # no local store yet either: an empty one, in memory
    try:
        with open_deps(settings, state=state, create=False, client=client) as deps:
            if missing is not None:
                if deps.store.alias_target(settings.alias) is not None:
                    # the alias serves: its state DB is elsewhere (a typo in KB_STATE_URL?) or lost, never new
                    raise missing
                _log().warning("kb_reindex: no state DB yet and %s serves nothing: previewing a first run; nothing "
                               "is created", settings.alias)
            return int(args.func(args, deps))
    finally:
        state.dispose()


def _cmd_plan(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.run.pipeline import chunk_counts, empty_result
    from kb_reindex.steps.build import BuildCounts
    from kb_reindex.steps.plan import plan

    p = plan(deps)
    human = _run_human({**empty_result("no_change" if p.no_change else "would_build").to_dict(),
                        "docs": p.docs.to_dict(), "chunks": chunk_counts(p, BuildCounts()).to_dict(),
                        "doc_keys": p.doc_keys.to_dict(), "notes": list(p.notes)})
    _print(args, p.to_dict(), human + f"\nmodel: {p.embedder}/{p.embed_model}  layout: {p.payload_layout}  "
                                      f"live: v{p.base_version or '-'}")
    return 0


def _all_bases(args: argparse.Namespace, registry: Registry, removed: Sequence[KnowledgeBase]) -> int:
    """`status` or `bases` with several knowledge bases and none named: every one of them, an entry that does not
    load among them with its refusal beside what it serves (exit 2, each refusal named on stderr), and one the
    registry no longer lists, never retired, with what it serves (`removed`)."""
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.run.status import status_view
    from kb_reindex.services.config import state_url_from_env

    state_url = state_url_from_env()
    if args.command == "bases":
        return _print_bases(args, registry, state_url)
    from kb_reindex.run.bases import recorded_entry, retired_refusals, retirements
    from kb_reindex.services.registry import stand_in
    from kb_reindex.services.runtime import open_deps

    answers: list[dict[str, Any]] = []
    human, code = [], 0
    retired = retirements(state_url)  # left out; an entry still listed is refused, naming its retirement
    broken = [stand_in(alias, registry=registry.path, problem=error, recorded=recorded_entry(state_url, alias))
              for alias, error in registry.broken.items() if alias not in retired]
    for kb in registry.in_order((*[b for b in registry.bases if b.alias not in retired], *broken, *removed)):
        try:
            with open_deps(kb.settings(on_call=True), create=False) as deps:
                s = status_view(deps)
        except ConfigError as exc:  # this one never built (or misconfigured): said, and the others still shown
            answers.append({"alias": kb.alias, "problems": [str(exc)], "registry_error": kb.problem})
            human.append(f"== {kb.alias} ==\nPROBLEM: {exc}\n")
            code = max(code, 1)
            continue
        answers.append({**s.to_dict(), "registry_error": kb.problem})
        human.append(f"== {kb.alias} ==\n{_status_human(s)}\n"
                     + (f"PROBLEM: registry: {kb.problem}\n" if kb.problem else ""))
        code = max(code, 1 if s.problems or s.last_run_problem else 0)
    refused = (*registry.errors, *retired_refusals(registry, retired))
    human += [f"PROBLEM: registry: {message}" for message in refused
              if message not in registry.broken.values() or any(registry.broken.get(a) == message for a in retired)]
    _print(args, {"knowledge_bases": answers, "refused": list(refused)}, "\n".join(human))
    # a knowledge base removed from the registry and never retired is named too, as `--kb <it> status` does
    return _refusals_named((*refused, *(kb.problem for kb in removed if kb.problem))) or code


def _refusals_named(refused: Sequence[str]) -> int:
    """A registry entry refused is a configuration error (exit 2), named on stderr: never hidden by a listing."""
    for message in refused:
        print(f"kb-reindex: error: registry: {message}", file=sys.stderr)
    return 2 if refused else 0


def _print_bases(args: argparse.Namespace, registry: Registry, state_url: str) -> int:
    from kb_reindex.run.bases import bases_view, when_it_runs

    view = bases_view(registry, state_url)
    rows = [{"alias": b.alias, "live": f"v{b.live_version}" if b.live_version else "-",
             "model": f"{b.embed_model} {b.dim}-d" if b.embed_model else "-", "frozen": "FROZEN" if b.frozen else "",
             "last run": f"{b.last_run.kind} {b.last_run.outcome} {b.last_run.started_at}" if b.last_run else "-",
             "shadow": ", ".join(f"v{n} (never served)" for n in b.shadows),
             "schedule": when_it_runs(b.schedule, b.source_poll_s),
             "problem": f"{len(b.problems)}, below" if b.problems else "",
             "flagged": (f"{b.served_instructions} ({b.instructions_accepted_by or 'a run'})"
                         if b.served_instructions else "-")}
            for b in view.bases]
    human = _table(rows, ["alias", "live", "model", "frozen", "shadow", "flagged", "last run", "schedule", "problem"])
    named = {b.registry_error for b in view.bases}
    # in full below the table, one a line: a registry error in a cell stretched every row past a terminal's width
    human += "".join(f"\nPROBLEM: {b.alias}: {problem}" for b in view.bases for problem in b.problems)
    human += "".join(f"\nPROBLEM: registry: {refused}" for refused in view.refused if refused not in named)
    _print(args, view.to_dict(), human)
    # a knowledge base removed from the registry and never retired is named as a refusal is (exit 2)
    removed = [b.registry_error for b in view.bases if b.registry_error and b.registry_error not in view.refused]
    return _refusals_named((*view.refused, *removed))


def _status_human(s: StatusView) -> str:
    from kb_reindex.domain.validation_model import NO_GOLDEN_SET
    from kb_reindex.run.status import KEPT_NOTES
    data = s.to_dict()
    rows = [{**row, "status": v.status + (" *rollback target" if v.rollback_target else "")
             + (f" *{KEPT_NOTES[v.kept]}" if v.kept else "") + (" *pinned" if v.pinned else "")}
            for v, row in zip(s.versions, data["versions"], strict=True)]
    return "\n".join([_status_head(s), "", _table(rows, ["version", "status", "collection", "points", "embed_model",
                                                        "dim", "payload_layout", "hit_rate", "mrr", "created_at"])]
                      + ([f"\nFROZEN: {s.freeze.message} (promotions held; `kb-reindex unfreeze` lifts it)"]
                         if s.freeze else [])
                      + _pins_and_audit_human(s)
                      + _metrics_human(s)
                      + ([f"\nlocks:\n{_table(data['locks'], ['name', 'owner', 'since', 'expires', 'owner_alive'])}"]
                         if s.locks else [])
                      + _review_human(s)
                      + [f"NOTE: {n}" for n in s.notes]
                      + [f"WARNING: {w.message}" if w.kind == NO_GOLDEN_SET else
                         f"WARNING: live serves {'an' if w.message[0] in 'aeiou' else 'a'} {w.message} (look at it; "
                         "never acted on)" for w in s.warnings]
                      + ([f"NOTE: {s.served_instructions.message}"] if s.served_instructions else [])
                      + [f"PROBLEM: {p}" for p in (*s.problems, *([s.last_run_problem] if s.last_run_problem else []))])


def _review_human(s: StatusView) -> list[str]:
    """Each held version's new instruction-like lines, in the lines around them, and the two answers."""
    out = []
    for v in s.versions:
        if not v.review:
            continue
        out.append(f"\nHELD v{v.version}: {len(v.review)} instruction-like line(s) live does not serve:")
        for f in v.review:
            out.append(f"  {f.source}:{f.line}" + (f" ({f.why})" if f.why else ""))
            out += [f"      {line}" for line in f.before] + [f"    > {f.text}"] + [f"      {line}" for line in f.after]
        out.append(f"  promote it: `kb-reindex promote --version {v.version} --reason ...`; or not: "
                   f"`kb-reindex keep-live --version {v.version} --reason ...`")
    return out


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:g} s"


def _metrics_human(s: StatusView) -> list[str]:
    """The run metrics (`status --json`'s `metrics`, the page's table), each labelled."""
    m = s.metrics
    return ["", f"metrics ({m.runs} reindex/migration run(s) counted): success rate {_share(m.run_success_rate)}, "
                f"{m.failed_runs} failed; last run took {_seconds(m.last_run_duration_s)}",
            f"  last promotion: {'-' if m.last_changed_chunks is None else m.last_changed_chunks} chunk(s) embedded, "
            f"embedding reuse {_share(m.last_embedding_reuse_rate)}, source to searchable "
            f"{_seconds(m.last_source_to_searchable_s)}",
            f"  failures: {m.alias_switch_failures} alias switch, {m.embedding_failures} embedding; newest ready "
            f"unpromoted version waiting {_seconds(m.ready_unpromoted_age_s)}"]


def _cmd_status(args: argparse.Namespace, deps: Any) -> int:
    """What serves and every version; an entry that does not load (`registry_error`): the same, its refusal
    beside it, exit 2 (a configuration error stands)."""
    from kb_reindex.run.status import status_view
    s = status_view(deps)
    refused = getattr(args, "registry_error", None)
    _print(args, {**s.to_dict(), "registry_error": refused},
           _status_human(s) + (f"\nPROBLEM: registry: {refused}" if refused else ""))
    if refused:
        print(f"kb-reindex: error: registry: {refused}", file=sys.stderr)
        return 2
    return 1 if s.problems or s.last_run_problem else 0


def _cmd_validate(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.domain.validation_model import NO_GOLDEN_SET
    from kb_reindex.run.pipeline import validation_summary
    from kb_reindex.steps.validate import validate

    number = args.version
    if number is None:
        live = deps.state.live_version(deps.settings.alias)
        if live is None:
            raise ConfigError("no live version; name one with --version")
        number = live.version
    _existing_version(deps, number, "--version")
    result = validate(deps, number, raise_on_failure=False)
    summary = validation_summary(result).to_dict()
    _print(args, {"version": number, **summary, "checks": [c.to_dict() for c in result.checks]},
           f"v{number}: {'passed' if result.passed else 'FAILED'}  "
           + (f"hit rate {result.hit_rate}  MRR {result.mrr}" if result.hit_rate is not None else "no golden probes scored")
           + f"  report {result.report}"
           + "".join(f"\n  failure: {f}" for f in result.failures)
           + "".join(f"\n  WARNING: {w.text}" for w in result.warnings if w.kind == NO_GOLDEN_SET))
    return 0 if result.passed else 1


def _cmd_gc(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.steps.retention import cleanup

    result = cleanup(deps).to_dict()
    _print(args, result, _table(result["deleted"], ["version", "collection", "was"]))
    return 0


def _cmd_drop(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.steps.retention import drop_version

    _existing_version(deps, args.version, "--version")
    result = drop_version(deps, args.version)
    _print(args, result.to_dict(), f"v{result.version} ({result.collection}) was already deleted"
           if result.already_deleted else f"dropped v{result.version} ({result.collection}, was {result.was})")
    return 0


def _cmd_restore(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.steps.restore import restore_version

    _existing_version(deps, args.version, "--version")
    result = restore_version(deps, args.version)
    _print(args, result.to_dict(), f"v{result.version} already resides in {result.collection}: one alias move away"
           if result.already else f"v{result.version} restored into {result.collection}: {result.written} point(s) "
           f"written, {result.kept} kept, nothing embedded; `kb-reindex rollback --to-version {result.version}` "
           "puts it live")
    return 0


def _cmd_promote(args: argparse.Namespace, deps: Any) -> int:
    """Confirmed by `_dispatch` before the lock is taken (`_confirm_promotion`)."""
    from kb_reindex.run.pipeline import promote_shadow
    from kb_reindex.services.runtime import new_run_id

    _existing_version(deps, args.version, "--version")
    from kb_reindex.rules.freeze import operator

    result = promote_shadow(deps, args.version, expected_live=args.live_version, run_id=new_run_id("promote"),
                            by=operator(), **({"reason": args.reason} if args.reason else {}))
    _print(args, result.to_dict(), f"promoted v{result.version} ({result.collection}, {result.embed_model} "
                                   f"{result.dim}-d); v{result.previous_version or '-'} kept for rollback")
    return 0


def _cmd_keep_live(args: argparse.Namespace, deps: Any) -> int:
    """A held (or any never-served ready) version declined by a person: the state DB alone, like a freeze."""
    from kb_reindex.rules.freeze import operator
    from kb_reindex.steps.review import decline

    _existing_version(deps, args.version, "--version")
    declined = decline(deps.state, deps.settings.alias, args.version, by=operator(), reason=args.reason)
    _print(args, {"version": declined.version, "status": declined.status, "error": declined.error},
           f"v{declined.version} is not promoted: {declined.error}")
    return 0


def _cmd_freeze(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.rules.freeze import operator

    alias = deps.settings.alias
    before = deps.state.freeze_status(alias)
    freeze = deps.state.freeze(alias, reason=args.reason, by=operator())
    _print(args, {**freeze.view(), "already_frozen": before is not None},
           (f"already frozen, kept as it was: {freeze.describe()}" if before is not None else
            f"{freeze.describe()}\nruns still build and validate, but nothing moves the alias forward until "
            "`kb-reindex unfreeze`; rollbacks still run"))
    return 0


def _cmd_unfreeze(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.rules.freeze import operator

    alias = deps.settings.alias
    lifted = deps.state.unfreeze(alias, by=operator())
    ready = [v.version for v in deps.state.list_versions(alias, statuses=["ready"]) if v.promoted_at is None]
    hint = (f"; kept unpromoted: {', '.join(f'v{n}' for n in ready)} (`kb-reindex promote --version N`, or the "
            "next run of the same plan promotes it)") if ready else ""
    _print(args, {"alias": alias, "frozen": False, "was_frozen": lifted is not None,
                  "lifted": lifted.view() if lifted else None, "unpromoted": ready},
           (f"{alias} unfrozen (was: {lifted.describe()}){hint}" if lifted else f"{alias} was not frozen{hint}"))
    return 0


def _cmd_retire(args: argparse.Namespace, deps: Any) -> int:
    """`retire`: the state DB's part always, Qdrant only with --drop-collections (a build holding a local-mode store
    never keeps on-call from retiring); `--undo` ends it. A second retire says it was already retired (exit 0)."""
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.domain.model import RunOutcome
    from kb_reindex.rules.freeze import operator
    from kb_reindex.rules.retirement import undo_hint
    from kb_reindex.services.registry import registry_path
    from kb_reindex.steps.retire import retire, unretire

    alias = deps.settings.alias
    if args.undo:
        if args.drop_collections or args.reason:
            raise ConfigError("retire --undo takes no --reason or --drop-collections: it only ends the retirement")
        ended = unretire(deps, by=operator())
        _print(args, {"alias": alias, "retired": False, "was_retired": ended is not None,
                      "undone": ended.view() if ended else None},
               f"{alias}: retirement undone (was: {ended.describe()}); it is built, promoted and rolled back again"
               + ("" if ended.dropped_at is None else "; its collections were dropped: the next run builds one from "
                  "scratch") if ended else f"{alias} was not retired")
        return 0
    if not args.reason or not args.reason.strip():
        raise ConfigError("retire needs --reason (it is recorded with who retired it and when)")
    if args.drop_collections and not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError("retire --drop-collections needs confirmation: pass --yes when not running in a terminal")
        print(f"{alias}: delete the alias and drop every collection of it (every version; readers find nothing "
              "under that name afterwards)", file=sys.stderr if args.json else sys.stdout)
        if input("Retire and drop? Type 'yes': ").strip().lower() != "yes":
            _print(args, {"outcome": RunOutcome.CANCELLED, "changed": False, "message": "nothing changed"},
                   "nothing changed")
            return 0
    result = retire(deps, reason=args.reason, by=operator(), drop_collections=args.drop_collections)
    listed = getattr(args, "listed_in", None)
    entry = (f"\nits entry is still in {listed}: remove it; until then its DAGs stay and every run or alias move "
             "of them is refused, as is the entry on every command") if listed else ""
    _print(args, {**result.to_dict(), "registry_entry": str(listed) if listed else None},
           result.message + entry + f"\nundo: {undo_hint(alias, registered=registry_path() is not None)}")
    return 0


def _cmd_pin(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.steps.retention import pin_version

    result = pin_version(deps, args.version, reason=args.reason)
    _print(args, result.to_dict(), f"v{result.version} " + ("was already pinned" if result.already_pinned else "pinned")
           + f": {result.reason} ({result.pinned_by}, {result.pinned_at})")
    return 0


def _cmd_unpin(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.steps.retention import unpin_version

    result = unpin_version(deps, args.version)
    _print(args, result.to_dict(), f"v{result.version} unpinned; retention may drop it again" if result.was_pinned
           else f"v{result.version} was not pinned")
    return 0


def _cmd_reconcile(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.steps.reconcile import RebuildResult, ReconcileResult, reconcile

    if args.rebuild_state:
        from kb_reindex.steps.reconcile import rebuild_state

        result: ReconcileResult | RebuildResult = rebuild_state(deps, replace=args.replace)
    elif args.replace:
        raise ConfigError("--replace goes with --rebuild-state")
    else:
        result = reconcile(deps)
    _print(args, result.to_dict(), result.message)
    return 0


def _status_head(s: StatusView) -> str:
    """What the alias serves (read from Qdrant), not what the state DB records: in a drift the two differ,
    and the state DB's view is said beside it."""
    serving = next((v for v in s.versions if v.serving), None)
    if serving is not None:
        head = (f"alias {s.alias} -> v{serving.version} ({serving.collection}, {serving.points} points, "
                f"{serving.embed_model} {serving.dim}-d)")
    else:
        head = f"alias {s.alias} -> {s.serving_collection or 'nothing'}"
    if (s.live.collection if s.live else None) != s.serving_collection:
        recorded = f"v{s.live.version}" if s.live else "nothing"
        head += f"; the state DB says live is {recorded} (see PROBLEM below)"
    if s.rolled_back_from is not None:
        head += (f"\nrolled back from v{s.rolled_back_from}; undo: `kb-reindex rollback --to-version "
                 f"{s.rolled_back_from} --reason ...` (one alias move)")
    return head


def _pins_and_audit_human(s: StatusView) -> list[str]:
    """Status lines for pinned versions, the newest audit of live and the query log."""
    lines = [f"pinned: v{v.version} ({v.pin.reason}; {v.pin.by}, {v.pin.at})" for v in s.versions if v.pin]
    audit = s.audit
    if audit:
        lines.append(f"audit of live v{audit.version} ({audit.at}): {audit.points} points, manifest "
                     f"{audit.expected}; missing {audit.missing} ({audit.missing_ratio:.2%}), orphans "
                     f"{audit.orphans} ({audit.orphan_ratio:.2%})")
    logged = s.query_log
    lines.append(f"query log (KB_QUERY_LOG): {'on' if logged.enabled else 'off'}, {logged.queries} logged "
                 f"quer{'y' if logged.queries == 1 else 'ies'} held (keeps the newest {logged.keep})")
    return ([""] if lines else []) + lines


def _confirm_promotion(args: argparse.Namespace, deps: Any) -> bool:
    """Asked before the alias's lock is taken: a prompt left open must not block every rollback. Sets
    `args.live_version` to the version the prompt showed serving (or read now, with --yes): the promotion
    moves the alias only from it."""
    from kb_reindex.domain.errors import ConfigError

    shadow = deps.state.get_version(deps.settings.alias, args.version)
    if args.live_version is None:
        live = deps.state.live_version(deps.settings.alias)
        args.live_version = live.version if live else None
    if shadow is None or args.yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigError("promote needs confirmation: pass --yes when not running in a terminal")
    print(f"alias {deps.settings.alias}: v{args.live_version if args.live_version is not None else '-'} -> "
          f"v{shadow.version} ({shadow.collection}, {shadow.embed_model} "
          f"{shadow.embed_dim}-d, never served)")
    if input("Validate it again and switch the alias? Type 'yes': ").strip().lower() != "yes":
        print("nothing changed")
        return False
    return True


def _unlock(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.rules.locking import alias_lock_name, reindex_lock_name
    from kb_reindex.services.state.locks import default_lock_owner, is_dag_run_owner
    from kb_reindex.services.state.clock import utc_stamp

    alias = deps.settings.alias
    held = deps.state.list_locks(subject=alias)
    if not held:
        _print(args, {"alias": alias, "broken": []}, f"{alias}: no lock is held")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError("unlock needs confirmation: pass --yes when not running in a terminal")
        for row in held:
            print(f"{row.name}: held by {row.owner} since {row.acquired_at:%Y-%m-%d %H:%M:%S} UTC")
        if input("Break these locks? Type 'yes': ").strip().lower() != "yes":
            print("nothing changed")
            return 0
    broken = []
    for name in (reindex_lock_name(alias), alias_lock_name(alias)):
        holder = deps.state.break_lock(name, by=default_lock_owner(), reason=args.reason.strip())
        if holder is not None:
            broken.append({"name": name, "owner": holder.owner,
                           "since": utc_stamp(holder.acquired_at)})
            if any(row.name == name and row.owner_alive for row in held):
                _log().warning("kb_reindex: %s was held by %s, whose process is still alive: it will stop before it "
                               "promotes anything", name, holder.owner)
            elif is_dag_run_owner(holder.owner):
                _log().warning("kb_reindex: %s was held by the DAG run %s: its next task finds the lock gone and fails, "
                            "before it promotes anything", name, holder.owner)
    _print(args, {"alias": alias, "broken": broken},
           "\n".join(f"broke {b['name']} (held by {b['owner']} since {b['since']})" for b in broken))
    return 0


def _run_exit_code(result: dict[str, Any]) -> int:
    """A run stopped by a setting (e.g. no knowledge folder) is a configuration error, not a failed run."""
    from kb_reindex.domain.errors import UNAVAILABLE_EXIT, UNAVAILABLE_KINDS
    from kb_reindex.domain.model import RunOutcome

    if result["outcome"] in ("auto_rolled_back", "regressed"):  # the watch undid (or could not undo) it
        return 1
    if result["outcome"] == RunOutcome.HELD:  # built and validated, waiting for a person: a script must notice
        return 1
    if result["outcome"] != RunOutcome.FAILED:
        return 0
    if result.get("error_kind") in UNAVAILABLE_KINDS:
        return UNAVAILABLE_EXIT
    return 2 if result.get("error_kind") == "config" else 1


def _existing_version(deps: Any, number: int, flag: str) -> None:
    """A version number that names nothing is a usage error (exit 2), said before anything is touched."""
    from kb_reindex.domain.errors import ConfigError

    if deps.state.get_version(deps.settings.alias, number) is None:
        raise ConfigError(f"{flag} {number}: {deps.settings.alias} has no version {number}; "
                          "`kb-reindex status` lists the versions")


def _rollback(args: argparse.Namespace, deps: Any) -> int:
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.domain.model import RunOutcome
    from kb_reindex.rules.alias import rollback_target
    from kb_reindex.rules.freeze import operator
    from kb_reindex.run.runs import rollback_warnings, run_rollback, warning_line

    alias = deps.settings.alias
    # what on-call confirms: this live version, this target; the rollback moves nothing if another serves by then
    if args.live_version is not None:
        _existing_version(deps, args.live_version, "--live-version")
        live = deps.state.get_version(alias, args.live_version)
    else:
        live = deps.state.live_version(alias)
    if args.to_version is not None:
        _existing_version(deps, args.to_version, "--to-version")
    target = (deps.state.get_version(alias, args.to_version) if args.to_version
              else rollback_target(deps, live) if live else None)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError("rollback needs confirmation: pass --yes when not running in a terminal")
        # the question goes to stderr with --json: stdout carries only the one JSON answer
        ask = sys.stderr if args.json else sys.stdout
        print(f"alias {deps.settings.alias}: v{live.version if live else '-'} -> "
              f"v{target.version if target else '?'} ({target.collection if target else 'no target'})", file=ask)
        brought = rollback_warnings(live, target) if live and target else ()
        for w in brought:  # what it brings back that live does not serve: read before confirming
            print(f"  WARNING: it brings back {warning_line(w)}", file=ask)
        print("Switch the alias? Type 'yes': ", end="", file=ask, flush=True)
        if sys.stdin.readline().strip().lower() != "yes":
            # declining is an answer, not a failure
            _print(args, {"outcome": RunOutcome.CANCELLED, "changed": False, "message": "nothing changed"}, "nothing changed")
            return 0
    revalidate = not args.no_revalidate
    if revalidate and getattr(args, "registry_error", None):  # its golden set may be what its entry got wrong
        _log().warning("kb_reindex: its registry entry does not load: the target is not scored on a golden set")
        revalidate = False
    held = _rollback_freeze(args, deps)
    result = run_rollback(deps, reason=args.reason, to_version=target.version if target else None,
                          revalidate=revalidate, expected_live=live.version if live else None,
                          by=operator())
    _print(args, {**result.to_dict(), "freeze": held.to_dict() if held else None},
           f"rolled back: v{result.from_version} -> v{result.to_version} ({result.collection})"
           + (f"\n{held.message}; lift it with `kb-reindex unfreeze`" if held else
              "\nnot frozen: the next run rebuilds from the knowledge folder and may promote the change again "
              "(`kb-reindex freeze --reason ...`)"))
    return 0


def _rollback_freeze(args: argparse.Namespace, deps: Any) -> FreezeView | None:
    """`rollback --freeze`: the freeze goes in first, so nothing moves the alias forward between the two."""
    if not args.freeze:
        return None
    from kb_reindex.rules.freeze import FreezeView, freeze_for_rollback, operator

    return FreezeView.of(freeze_for_rollback(deps, reason=args.reason, by=operator()))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
