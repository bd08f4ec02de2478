"""Names that come from outside (file names, object keys, front-matter fields) and are printed: in logs, errors,
the page. A name holding a newline, another control character or a bidirectional control can forge a log line
or show something other than what it is, so such a name is refused, and shown escaped when it is."""

from __future__ import annotations

import unicodedata

#: control, format (bidirectional controls, zero-width characters), line and paragraph separators, surrogates,
#: private use and unassigned code points
UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def unprintable(text: str) -> list[str]:
    """The characters of `text` no reader should get unescaped, each once, in order met."""
    if text.isprintable():  # none of them: str.isprintable is False for every category of UNPRINTABLE (fast path)
        return []
    found: dict[str, None] = {}
    for char in text:
        if unicodedata.category(char) in UNPRINTABLE:
            found.setdefault(char)
    return list(found)


def escaped(text: str) -> str:
    """`text` with each unprintable character written as its escape (`\\n`, `\\u202e`): safe on one line."""
    return "".join(_SHORT.get(c) or (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
                   if unicodedata.category(c) in UNPRINTABLE else c for c in text)


def name_problem(text: str, *, what: str, fix: str | None = "rename it") -> str | None:
    """Why `text` cannot be `what` (a file name, a title), one line with the name escaped and what to do
    (`fix`); None when it can."""
    bad = unprintable(text)
    if not bad:
        return None
    shown = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in bad[:4])
    return f"{escaped(text)!s}: its {what} holds {len(bad)} unprintable character(s) ({shown}); refused" + (
        f": {fix}" if fix else "")


def shortened(text: str, limit: int = 100) -> str:
    """`text` escaped and, past `limit` characters, cut in the middle with its length said: an error line stays
    readable whatever the name."""
    shown = escaped(text)
    if len(shown) <= limit:
        return shown
    half = (limit - 5) // 2
    return f"{shown[:half]}...{shown[-half:]} ({len(text):,} characters)"
