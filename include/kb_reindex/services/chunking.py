"""Markdown-aware chunking that keeps a rule's condition and its conclusion together.

Sections (by heading) are never merged; inside a section paragraphs are packed up to `chunk_size`
characters; an over-long paragraph is split at Chinese or Western sentence ends, and an over-long
sentence at `chunk_size`. Neighbouring chunks of a section share about `overlap` characters, taken as
whole sentences where they fit. Each chunk's text starts with "title > section" so that a chunk read
alone still says which rule it belongs to (and that context shapes its embedding).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from kb_reindex.domain.screen_text import visible_text
from kb_reindex.services.sources import Document, sha256_text

CHUNKER_NAME = "md-sections-v2"
POINT_ID_NAMESPACE = uuid.UUID("6f0b7c7e-2d0a-5b8e-9f4c-6b62a1d3c0de")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# Zero-width: splitting keeps every character, so sentences rejoin to exactly the original text.
_SENTENCE_END = re.compile(r"(?<=[。！？；!?;\n])|(?<=\.)(?=\s)")
MIN_CHUNK_CHARS = 2
#: the fewest characters `page_sections` takes for a chunk's overlap with the one before it
MIN_OVERLAP = 10


@dataclass(frozen=True)
class Chunk:
    knowledge_key: str
    chunk_index: int
    section: str
    text: str
    chunk_hash: str
    point_id: str


def chunking_version(chunk_size: int, overlap: int) -> str:
    """Reuse of vectors is only sound when chunks were cut the same way."""
    return f"{CHUNKER_NAME}/size={chunk_size}/overlap={overlap}"


def point_id_for(knowledge_key: str, chunk_index: int, chunk_hash: str) -> str:
    """Stable: an unchanged chunk keeps its ID across versions, so reruns upsert instead of duplicating."""
    return str(uuid.uuid5(POINT_ID_NAMESPACE, f"{knowledge_key}\x1f{chunk_index}\x1f{chunk_hash}"))


def _sections(body: str, doc_title: str) -> list[tuple[str, str]]:
    """(section path, text) pairs in document order; the path joins the heading trail with ' > '.

    An H1 that is the document's title is left out (every chunk's header starts with the title); one
    that differs from it (a front matter `title` of its own) stays in the path, so its words are indexed."""
    trail: list[tuple[int, str]] = []
    sections: list[tuple[str, list[str]]] = [("", [])]
    in_fence = False
    for line in body.split("\n"):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else _HEADING.match(line)
        if match:
            level, title = len(match.group(1)), match.group(2)
            trail = [(lvl, t) for lvl, t in trail if lvl < level] + [(level, title)]
            path = " > ".join(t for lvl, t in trail if lvl > 1 or t.strip() != doc_title.strip())
            sections.append((path, []))
        else:
            sections[-1][1].append(line)
    return [(path, "\n".join(lines).strip()) for path, lines in sections if "\n".join(lines).strip()]


def _sentences(paragraph: str, limit: int) -> list[str]:
    """Sentences with their own punctuation and whitespace; one longer than `limit` is cut at `limit`."""
    out: list[str] = []
    for piece in _SENTENCE_END.split(paragraph):
        while len(piece) > limit:
            out.append(piece[:limit])
            piece = piece[limit:]
        if piece:
            out.append(piece)
    return out


@dataclass(frozen=True)
class _Unit:
    """A piece chunks are packed from: a paragraph that fits, a sentence of one that does not, or rows of an
    over-long table under its header row (`table`: such a piece starts its own chunk, carrying no overlap)."""

    text: str
    paragraph: int
    table: bool = False


_TABLE_SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?$")


def _table_rows(paragraph: str) -> tuple[str, list[str]] | None:
    """(header and separator lines, body rows) of a Markdown table paragraph, else None."""
    lines = paragraph.split("\n")
    if len(lines) < 3 or not all(line.lstrip().startswith("|") for line in lines) \
            or not _TABLE_SEPARATOR.match(lines[1].strip()):
        return None
    return "\n".join(lines[:2]), lines[2:]


def _table_units(head: str, rows: list[str], number: int, limit: int) -> list[_Unit]:
    """Rows packed under the header row, up to `limit` characters; a row too long even alone is cut, each
    part under the header too. Every piece is a table read alone: its columns are named."""
    room = max(limit - len(head) - 1, limit // 2)
    groups: list[str] = []
    current = ""
    for row in rows:
        for part in [row[i:i + room] for i in range(0, len(row), room)] or [row]:
            if current and len(current) + 1 + len(part) > room:
                groups.append(current)
                current = ""
            current = f"{current}\n{part}" if current else part
    if current:
        groups.append(current)
    return [_Unit(f"{head}\n{group}", number, table=True) for group in groups]


def _units(text: str, limit: int) -> list[_Unit]:
    """Paragraphs that fit, else their sentences (or, for a table, its rows under its header row)."""
    units: list[_Unit] = []
    for number, paragraph in enumerate(re.split(r"\n\s*\n", text)):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        if len(paragraph) <= limit:
            units.append(_Unit(paragraph, number))
        elif (table := _table_rows(paragraph)) is not None:
            units.extend(_table_units(*table, number, limit))
        else:
            units.extend(_Unit(piece, number) for piece in _sentences(paragraph, limit))
    return units


def _tail(text: str, overlap: int) -> str:
    """The last whole sentences of `text` within `overlap` chars; else its last `overlap` chars."""
    if overlap <= 0:
        return ""
    tail = ""
    for sentence in reversed(_SENTENCE_END.split(text)):
        if len(sentence) + len(tail) > overlap:
            break
        tail = sentence + tail
    tail = tail.lstrip()
    return tail or text[-overlap:]


def _pack(units: list[_Unit], size: int, overlap: int) -> list[str]:
    """Greedy packing; sentences of one paragraph are rejoined as they were, paragraphs by a blank line.
    Rows of a split table each start a chunk of their own, with the table's header row and no overlap."""
    chunks: list[str] = []
    current, last_paragraph = "", -1
    for piece in units:
        unit, paragraph = piece.text, piece.paragraph
        joiner = "" if not current else ("" if paragraph == last_paragraph else "\n\n")
        if current and (piece.table or len(current) + len(joiner) + len(unit) > size):
            chunks.append(current)
            carried = "" if piece.table else _tail(current, overlap)
            current = f"{carried}{unit}" if carried and len(carried) + len(unit) <= size else unit.lstrip()
        else:
            current = f"{current}{joiner}{unit}"
        last_paragraph = paragraph
    if current:
        chunks.append(current)
    return chunks


def chunk_document(doc: Document, *, chunk_size: int = 500, overlap: int = 50) -> list[Chunk]:
    """The document's chunks, cut from what a reader of the page sees: HTML comments are not served to the
    assistant (`screen_text.visible_text`; the instruction screen still reads them)."""
    chunks: list[Chunk] = []
    for section, text in _sections(visible_text(doc.body), doc.title):
        body_budget = max(chunk_size - len(doc.title) - len(section) - 4, chunk_size // 2)
        for body in _pack(_units(text, body_budget), body_budget, overlap):
            body = body.strip()
            if len(body) < MIN_CHUNK_CHARS:
                continue
            header = f"{doc.title} > {section}" if section else doc.title
            chunk_text = f"{header}\n{body}"
            index = len(chunks)
            chunk_hash = sha256_text(chunk_text)
            chunks.append(
                Chunk(
                    knowledge_key=doc.knowledge_key,
                    chunk_index=index,
                    section=section,
                    text=chunk_text,
                    chunk_hash=chunk_hash,
                    point_id=point_id_for(doc.knowledge_key, index, chunk_hash),
                )
            )
    return chunks


def _overlap(before: str, after: str) -> int:
    """How many characters `after` starts with that `before` ends with (0 under MIN_OVERLAP: a chunk that
    carried nothing, such as a table's next rows, may start with the character the one before ends with)."""
    for k in range(min(len(before), len(after)), MIN_OVERLAP - 1, -1):
        if before.endswith(after[:k]):
            return k
    return 0


def page_sections(chunks: list[str]) -> list[list[str]]:
    """A page's sections as lines, rebuilt from its chunk texts (`chunk_document`'s, in order): each chunk's
    first line (its "title > section" header) dropped, and the start a chunk repeats of the one before it in the
    same section (the overlap `_pack` carries, glued to the next paragraph) cut, the rest starting a line. So a
    line of the page (a held version's flagged one, `steps.review`) is found once, whole, among its neighbours,
    not beside a header or a cut-off tail."""
    sections: list[list[str]] = []
    header_before, body_before = None, ""
    for text in chunks:
        header, _, body = text.partition("\n")
        if header == header_before and sections:
            sections[-1].extend(body[_overlap(body_before, body):].lstrip("\n").splitlines())
        else:
            sections.append(body.splitlines())
        header_before, body_before = header, body
    return sections
