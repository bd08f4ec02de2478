"""YAML that comes from outside (a page's front matter, the golden set, the registry, collection settings), read
within limits.

A kilobyte of YAML can stand for billions of nodes: anchors of anchors ("billion laughs"), merge keys of merge
keys. PyYAML builds every one of them. So the text is first composed into its node graph (aliases stay shared
references, cheap whatever they stand for), that graph is walked as the loader would expand it, counting nodes
and depth, and only a document within the limits is constructed. Past a limit, one error names the file and the
line: nothing hangs, nothing grows without bound, and no lock is held by a parse that never ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from kb_reindex.domain.errors import ConfigError, KbError

#: libyaml when present: the same rules, much faster
FAST_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class YamlLimits:
    """How much YAML is read: bytes of text, nodes once aliases are expanded, and nesting depth."""

    max_bytes: int
    max_nodes: int
    max_depth: int = 64


#: a page's front matter: a few fields
FRONT_MATTER = YamlLimits(max_bytes=64 * 1024, max_nodes=10_000)
#: a file of settings or probes (the golden set, the registry)
SETTINGS_FILE = YamlLimits(max_bytes=16 * 1024 * 1024, max_nodes=500_000)


def _text_dates(base: Any) -> type:
    """`base` with dates and times read as the text they are: a front-matter `title: 2026-13-45` is a title,
    not an impossible date that ends in a traceback."""
    resolvers = {first: [(tag, regexp) for tag, regexp in found if tag != "tag:yaml.org,2002:timestamp"]
                 for first, found in base.yaml_implicit_resolvers.items()}
    return type(f"{base.__name__}TextDates", (base,), {"yaml_implicit_resolvers": resolvers})


TEXT_DATES_LOADER: type = _text_dates(FAST_LOADER)


def load_yaml(text: str, *, where: str, limits: YamlLimits = SETTINGS_FILE, loader: type = FAST_LOADER,
              error: type[KbError] = ConfigError) -> Any:
    """The document `text` holds, read by `loader` (a SafeLoader) within `limits`; past one, `error` naming
    `where`. Invalid YAML raises `yaml.YAMLError` as `yaml.load` would, for the caller to word; a value no
    constructor can make (an impossible date) is `error` too."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise error(f"{where}: {size:,} bytes of YAML, more than the {limits.max_bytes:,} read")
    parser = loader(text)
    try:
        node = parser.get_single_node()
        if node is None:
            return None
        _within(node, where=where, limits=limits, error=error)
        try:
            return parser.construct_document(node)
        except (ValueError, TypeError, OverflowError) as exc:
            raise error(f"{where}: a value YAML cannot read ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:200]})") from None
    finally:
        parser.dispose()


def _within(root: yaml.Node, *, where: str, limits: YamlLimits, error: type[KbError]) -> None:
    """Walk the node graph as construction would expand it (an alias visited once per use), stopping at the
    first limit passed."""
    seen = 0
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        seen += 1
        line = node.start_mark.line + 1 if node.start_mark is not None else "?"
        if seen > limits.max_nodes:
            raise error(f"{where}: YAML that expands to more than {limits.max_nodes:,} values (anchors and aliases "
                        f"used within each other?), refused at line {line}")
        if depth > limits.max_depth:
            raise error(f"{where}: YAML nested more than {limits.max_depth} levels deep, refused at line {line}")
        if isinstance(node, yaml.SequenceNode):
            stack += [(child, depth + 1) for child in node.value]
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack += [(key, depth + 1), (value, depth + 1)]
