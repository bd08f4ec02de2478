"""Reading the knowledge: Markdown files in a folder, or objects under a bucket's prefix, become `Document`s
with a stable key and a SHA-256.

One code path for both: a `KnowledgeSource` is an fsspec filesystem and a folder in it (fsspec's
`LocalFileSystem` for a local folder, s3fs for `s3://bucket/prefix`); `listing` says what is there without
reading a byte (name, size, mtime, ETag), `read_bytes` reads one document. Only a local folder's listing
differs, because links exist only there (`discover`: followed inside the folder, refused by name otherwise).

A bad file stops the run with an error naming it (the safe default): serving yesterday's complete
knowledge is better than serving today's with a policy silently missing.
"""

from __future__ import annotations

import hashlib
import operator
import os
import stat
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, NamedTuple, Protocol

import yaml

from kb_reindex.domain.errors import KnowledgeFolderMissing, SourceError, SourceRefused
from kb_reindex.domain.freshness import ListedFile, Listing
from kb_reindex.domain.names import name_problem, shortened
from kb_reindex.services.object_store import BucketLocation, bucket_failure, endpoint_of
from kb_reindex.services.yaml_input import FRONT_MATTER, TEXT_DATES_LOADER, load_yaml

FRONT_MATTER_FIELDS = ("title", "category", "tenant")
# the state DB's column sizes: refuse here, with the file named, rather than fail inside MySQL
MAX_LENGTHS = {"knowledge_key": 255, "source": 512, "title": 512, "category": 128, "tenant": 128}
DEFAULT_CATEGORY = "general"
DEFAULT_TENANT = "default"


class HasContentHash(Protocol):
    # read-only: frozen dataclasses and named tuples satisfy it
    @property
    def knowledge_key(self) -> str: ...

    @property
    def content_hash(self) -> str: ...


@dataclass(frozen=True)
class Document:
    knowledge_key: str
    source: str
    title: str
    category: str
    tenant: str
    body: str
    content_hash: str
    #: the file's line number of the body's first line (after the front matter)
    body_line: int = 1


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normalize_text(text: str) -> str:
    """Line endings and BOM must not change a hash: the same rules saved on Windows are the same rules."""
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def knowledge_key_for(source: str) -> str:
    """`faq/退货.md` -> `faq/退货`: the path under the docs folder, POSIX separators, without the suffix."""
    stem, dot, suffix = source.rpartition(".")
    return unicodedata.normalize("NFC", stem if dot and "/" not in suffix else source)


def _split_front_matter(text: str, source: str) -> tuple[dict[str, str], str]:
    if not text.startswith("---\n"):
        return {}, text
    end = text.find("\n---", 4)
    if end == -1:
        raise SourceError(f"{source}: front matter starts with '---' but has no closing '---' line")
    raw = text[4:end]
    after = text[end + 4 :]
    if after and not after.startswith("\n"):
        raise SourceError(f"{source}: front matter closing '---' must stand alone on its line")
    try:
        meta = load_yaml(raw, where=f"{source}: front matter", limits=FRONT_MATTER, loader=TEXT_DATES_LOADER,
                         error=SourceError) if raw.strip() else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 2})" if mark is not None else ""
        raise SourceError(f"{source}: front matter is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(meta, dict):
        raise SourceError(f"{source}: front matter must be a mapping of fields, got {type(meta).__name__}")
    fields: dict[str, str] = {}
    for name in FRONT_MATTER_FIELDS:
        if name in meta and meta[name] is not None:
            value = meta[name]
            if not isinstance(value, (str, int, float)) or isinstance(value, bool) or not str(value).strip():
                raise SourceError(f"{source}: front matter field '{name}' must be non-empty text, got {value!r}")
            fields[name] = str(value).strip()
    return fields, after.lstrip("\n")


def _first_h1(body: str) -> str | None:
    for line in body.splitlines():
        if line.startswith("# ") and line[2:].strip():
            return line[2:].strip()
    return None


@dataclass(frozen=True)
class KnowledgeSource:
    """Where a knowledge base's documents are: a folder of an fsspec filesystem."""

    #: as configured and shown: the folder's path, or `s3://bucket/prefix`
    uri: str
    #: the folder in the filesystem's own terms: `/srv/docs`, `bucket/prefix`
    root: str
    fs: Any = field(compare=False, repr=False)
    #: the bucket, for a source in object storage; None: a local folder
    bucket: BucketLocation | None = None
    #: where its credentials come from, as a refusal names them
    credentials: str = ""

    @classmethod
    def folder(cls, path: Path) -> KnowledgeSource:
        from fsspec.implementations.local import LocalFileSystem

        return cls(uri=str(path), root=str(path), fs=LocalFileSystem())

    @classmethod
    def in_bucket(cls, location: BucketLocation, fs: Any, *, credentials: str) -> KnowledgeSource:
        return cls(uri=location.uri, root=location.root, fs=fs, bucket=location, credentials=credentials)

    @property
    def local(self) -> bool:
        return self.bucket is None

    @property
    def described(self) -> str:
        return f"knowledge folder {self.uri}" if self.local else f"knowledge source {self.uri}"

    def path_of(self, source: str) -> str:
        return f"{self.root.rstrip('/')}/{source}"

    def read(self, source: str) -> bytes:
        """One document's bytes: an object store's failure as the one line `bucket_failure` says."""
        try:
            return bytes(self.fs.cat_file(self.path_of(source)))
        except Exception as exc:
            if self.bucket is not None and (failure := bucket_failure(
                    exc, location=self.bucket, fs=self.fs, credentials=self.credentials)) is not None:
                raise failure from None
            raise


def as_source(docs: KnowledgeSource | Path) -> KnowledgeSource:
    return docs if isinstance(docs, KnowledgeSource) else KnowledgeSource.folder(docs)


def _over_limit(source: str, size: int, max_bytes: int) -> SourceError:
    return SourceError(f"{source}: file is {size:,} bytes, over the limit of {max_bytes:,} (KB_MAX_DOC_BYTES); "
                       "split it into several documents")


def read_bytes(knowledge: KnowledgeSource, source: str, *, max_bytes: int, size: int | None = None) -> bytes:
    """A document's bytes; one over `max_bytes` (by its listed `size`, before anything is fetched, and by
    what arrived) is refused by name."""
    if size is not None and size > max_bytes:
        raise _over_limit(source, size, max_bytes)
    data = knowledge.read(source)
    if len(data) > max_bytes:
        raise _over_limit(source, len(data), max_bytes)
    return data


def read_document(path: Path, docs_dir: Path, *, max_bytes: int, default_tenant: str = DEFAULT_TENANT) -> Document:
    """One file to one Document, or a SourceError that says what is wrong with it."""
    source = path.relative_to(docs_dir).as_posix()
    data = read_bytes(KnowledgeSource.folder(docs_dir), source, max_bytes=max_bytes, size=path.stat().st_size)
    return parse_document(path, source, data, default_tenant=default_tenant)


def document_hash(text: str, *, inherited_tenant: str | None) -> str:
    """What a document serves as: its text, and the tenant it inherits when its front matter names none and the
    knowledge base's default is not `default` (so a changed default re-embeds the documents it moves)."""
    if inherited_tenant is None or inherited_tenant == DEFAULT_TENANT:
        return sha256_text(text)
    return sha256_text(f"{text}\n\x00tenant:{inherited_tenant}")


def parse_document(path: PurePath, source: str, data: bytes, *, default_tenant: str = DEFAULT_TENANT) -> Document:
    if b"\x00" in data:
        raise SourceError(f"{source}: contains NUL bytes; this looks like a binary file, not Markdown")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(
            f"{source}: not valid UTF-8 at byte {exc.start} ({data[exc.start:exc.start + 4]!r}); "
            "save the file as UTF-8"
        ) from None
    text = normalize_text(text)
    if not text.strip():
        raise SourceError(f"{source}: file is empty or only whitespace")
    meta, body = _split_front_matter(text, source)
    if not body.strip():
        raise SourceError(f"{source}: has front matter but no content")
    document = Document(
        knowledge_key=knowledge_key_for(source),
        source=source,
        title=meta.get("title") or _first_h1(body) or path.stem,
        category=meta.get("category", DEFAULT_CATEGORY),
        tenant=meta.get("tenant", default_tenant),
        body=body,
        content_hash=document_hash(text, inherited_tenant=None if "tenant" in meta else default_tenant),
        body_line=text[: len(text) - len(body)].count("\n") + 1,
    )
    for name in FRONT_MATTER_FIELDS:
        if (problem := name_problem(getattr(document, name), what=f"front matter field '{name}'", fix=None)):
            raise SourceError(f"{source}: {problem}")
    for name, limit in MAX_LENGTHS.items():
        value = getattr(document, name)
        if len(value) > limit:
            raise SourceError(f"{source}: {name} is {len(value)} characters, over the limit of {limit}: {value[:40]!r}...")
    return document


#: what `list_source` answers: the listed documents and a problem line for each that cannot be listed
SourceListing = tuple[list[ListedFile], list[str]]


_BY_NAME = operator.attrgetter("name")


def discover(docs_dir: Path) -> tuple[list[ListedFile], list[str]]:
    """Markdown files under docs_dir, sorted by path, each with its size and mtime (links followed), and a
    problem line for every link that cannot be followed and every file that cannot be read.

    A link that stays inside the folder is read as what it points to, under its own name, like any file
    (a folder link's documents are then indexed twice, once under each path). A link leading outside the
    folder, a link to nothing, and a folder link that loops back are refused by name: serving knowledge
    with documents silently missing is worse than not serving the new version at all.

    Each folder is read once with `os.scandir`, whose entries know their type: a plain file costs one stat.
    """
    if not docs_dir.is_dir():
        raise KnowledgeFolderMissing(f"knowledge folder {docs_dir} does not exist or is not a folder (KB_KNOWLEDGE_DIR; a registry entry's `source`)")
    root = docs_dir.resolve()
    found: list[ListedFile] = []
    problems: list[str] = []

    def walk(folder: Path, prefix: str, walking: tuple[Path, ...]) -> None:
        """`walking`: the real folders being walked, outermost first; a link back into one would loop."""
        with os.scandir(folder) as scanned:
            entries = sorted((entry for entry in scanned if entry.name[0] != "."), key=_BY_NAME)
        for entry in entries:
            name = entry.name
            source = prefix + name
            is_markdown = len(name) > 3 and name[-3:].lower() == ".md"
            if entry.is_symlink():
                path = folder / name
                loop = link_loop(path)
                if loop is not None:
                    problems.append(f"{source}: is a link that never reaches a file ({loop}); refused")
                    continue
                target = path.resolve()
                if not target.exists():
                    if is_markdown or not Path(name).suffix:  # a document, or most likely a folder of them
                        problems.append(f"{source}: is a link to {target}, which does not exist; refused")
                    continue
                if not (target.is_dir() or is_markdown):
                    continue
                if not target.is_relative_to(root):
                    problems.append(f"{source}: is a link to {target}, outside the knowledge folder {root}; refused")
                    continue
                if target.is_dir() and any(real.is_relative_to(target) for real in walking):
                    problems.append(f"{source}: is a link to {target}, a folder that contains it; refused "
                                    "(following it would never end)")
                    continue
            try:
                if entry.is_dir():
                    path = folder / name
                    walk(path, source + "/", (*walking, path.resolve()))
                elif is_markdown and entry.is_file():  # a regular file (a FIFO would hang the read)
                    st = entry.stat()
                    found.append(ListedFile(source, st.st_size, st.st_mtime_ns))
            except OSError as exc:  # vanished between listing and stat
                problems.append(f"{source}: cannot be read ({exc.strerror or type(exc).__name__})")

    walk(docs_dir, "", (root,))
    # each folder walked in name order, a subfolder where its name falls: sorted by path component already
    return found, problems


def link_loop(path: Path, *, limit: int = 40) -> str | None:
    """`loop-a.md -> loop-b.md -> loop-a.md` when following the link comes back to a link already met (or
    goes on past `limit` links), else None. Names as the links hold them."""
    chain = [path.name]
    seen = {os.path.abspath(path)}
    current = path
    for _ in range(limit):
        try:
            if not current.is_symlink():
                return None
            link = os.readlink(current)
        except OSError:
            return None
        current = Path(os.path.normpath(current.parent / link))
        chain.append(link)
        key = os.path.abspath(current)
        if key in seen:
            return " -> ".join(chain)
        seen.add(key)
        # a link through a folder that is itself a link: leave that to resolve(), which reports its own loop
    return " -> ".join(chain[:5]) + f" -> ... (over {limit} links)"


def list_source(knowledge: KnowledgeSource) -> tuple[list[ListedFile], list[str]]:
    """The documents of a source, sorted by name, with a problem line for each that cannot be listed (a
    refused link). A folder: `discover`, then each file's stat (links followed). A bucket: one listing of
    the prefix (keys, sizes, ETags, last-modified), no object read; keys under a `.name` are skipped as
    hidden files are. A missing bucket, refused credentials or an endpoint that does not answer: one line."""
    if knowledge.local:
        files, problems = discover(Path(knowledge.root))
    else:
        files, problems = _list_bucket(knowledge), []
    # a name with a newline or a control character would forge log lines and errors: refused, shown escaped;
    # one longer than the state DB keeps: refused before it is read, shown shortened
    named = [(f, name_problem(f.source, what="name") or _length_problem(f.source)) for f in files]
    return [f for f, problem in named if problem is None], problems + [p for _f, p in named if p is not None]


class Named(NamedTuple):
    """What `list_named` found of a change feed's names."""

    #: the listing entries of the named documents there now
    found: list[ListedFile]
    #: the named documents not there (removed, or never there: a name the caller must know)
    absent: set[str]


def list_named(knowledge: KnowledgeSource, names: Iterable[str]) -> Named | None:
    """The listing entries of these documents alone (a change feed's names: what a watcher saw change), each
    looked at as `list_source` would list it; a name that is not a document (hidden, not Markdown) has none.
    None when a name cannot be judged alone, so the caller lists everything: a link on its path (only the
    folder's walk follows and refuses links), a folder, a name out of the folder (`..`, absolute), or one
    `list_source` would refuse."""
    found: list[ListedFile] = []
    absent: set[str] = set()
    for name in sorted(set(names)):
        parts = name.split("/")
        if (not name or name.startswith("/") or any(part in ("", ".", "..") for part in parts)
                or name_problem(name, what="name") or _length_problem(name)):
            return None
        if any(part.startswith(".") for part in parts) or PurePosixPath(name).suffix.lower() != ".md":
            if _is_folder(knowledge, name):
                return None  # documents under it may have changed: which ones, a listing says
            continue  # not a document: a listing would not show it either
        entry = _named_file(knowledge, name) if knowledge.local else _named_object(knowledge, name)
        if entry is None:
            return None
        if entry is _ABSENT:
            absent.add(name)
        else:
            found.append(entry)
    return Named(found, absent)


def _is_folder(knowledge: KnowledgeSource, name: str) -> bool:
    if knowledge.local:
        return (Path(knowledge.root) / name).is_dir()
    try:
        return bool(knowledge.fs.isdir(knowledge.root.rstrip("/") + "/" + name))
    except Exception:  # the listing that follows says what the bucket answers
        return True


#: `_named_file` / `_named_object`: the name is not there (removed since the last plan read it)
_ABSENT = ListedFile("", -1, 0)


def _named_file(knowledge: KnowledgeSource, name: str) -> ListedFile | None:
    folder = Path(knowledge.root)
    if not folder.is_dir():
        return None  # the listing says what is wrong with the folder
    path = folder
    for part in name.split("/"):
        path = path / part
        try:
            st = path.lstat()
        except FileNotFoundError:
            return _ABSENT
        except OSError:
            return None  # unreadable: the full listing names it
        if stat.S_ISLNK(st.st_mode):
            return None
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would hang the read; the walk skips it too
        return _ABSENT
    return ListedFile(name, st.st_size, st.st_mtime_ns)


def _named_object(knowledge: KnowledgeSource, name: str) -> ListedFile | None:
    assert knowledge.bucket is not None
    path = knowledge.root.rstrip("/") + "/" + name
    try:
        knowledge.fs.invalidate_cache(path)
        info = knowledge.fs.info(path)
    except FileNotFoundError:
        return _ABSENT
    except Exception as exc:
        failure = bucket_failure(exc, location=knowledge.bucket, fs=knowledge.fs, credentials=knowledge.credentials)
        if failure is not None:
            raise failure from None
        raise
    if info.get("type") != "file":
        return None
    return _listed_object(name, info)


def _listed_object(name: str, info: dict[str, Any]) -> ListedFile:
    """An object's listing entry from fsspec's `info` of it (a `find(detail=True)` value, or a HEAD's). Its
    modification time in whole seconds: a HEAD answers `Last-Modified` in seconds where some servers' listings
    (MinIO, GCS, Ceph) give milliseconds, and the two must agree (the ETag tells content apart; a record made
    before, in milliseconds, compares by `freshness.stat_key`)."""
    modified = info.get("LastModified") or info.get("mtime")
    mtime_ns = int(modified.timestamp()) * 1_000_000_000 if isinstance(modified, datetime) else 0
    etag = str(info.get("ETag") or "").strip('"') or None
    return ListedFile(name, int(info.get("size") or 0), mtime_ns, etag)


def _length_problem(source: str) -> str | None:
    if source.isascii() and len(source) <= MAX_LENGTHS["knowledge_key"]:  # NFC keeps ASCII as it is: both fit
        return None
    key = knowledge_key_for(source)
    for name, value in (("name", source), ("knowledge_key", key)):
        limit = MAX_LENGTHS["source" if name == "name" else name]
        if len(value) > limit:
            return f"{shortened(source)}: its {name} is {len(value):,} characters, over the limit of {limit}; refused"
    return None


def _list_bucket(knowledge: KnowledgeSource) -> list[ListedFile]:
    assert knowledge.bucket is not None
    fs = knowledge.fs
    try:
        fs.invalidate_cache(knowledge.root)  # a filesystem kept from an earlier listing must not answer from it
        found = fs.find(knowledge.root, detail=True)
    except Exception as exc:
        failure = bucket_failure(exc, location=knowledge.bucket, fs=fs, credentials=knowledge.credentials)
        if failure is not None:
            raise failure from None
        raise
    prefix = knowledge.root.rstrip("/") + "/"
    files = []
    for path, info in found.items():
        name = path[len(prefix):] if path.startswith(prefix) else ""
        if (info.get("type") != "file" or not name or any(part.startswith(".") for part in name.split("/"))
                or PurePosixPath(name).suffix.lower() != ".md"):
            continue
        files.append(_listed_object(name, info))
    return sorted(files, key=lambda f: f.source)


def listing(knowledge: KnowledgeSource | Path) -> Listing:
    """What the source holds now, without reading a document: each one's name, size, mtime and (in object
    storage) ETag, sorted by name, for a freshness watcher (`Listing.digest` moves with any write). A local
    folder's refused links are entries of size -1, so the change still reaches a plan, which names them."""
    files, problems = list_source(as_source(knowledge))
    return Listing(tuple(sorted([*files, *(ListedFile(problem, -1, 0) for problem in problems)])))


def iter_corpus(docs: KnowledgeSource | Path, *, max_bytes: int = 2_000_000,
                listed: dict[str, ListedFile] | None = None,
                default_tenant: str = DEFAULT_TENANT,
                known: Callable[[ListedFile], str | None] | None = None,
                files: SourceListing | None = None,
                again: Callable[[ListedFile], ListedFile | None] | None = None) -> Iterator[Document]:
    """Every document, one at a time in name order, so a caller keeps only what it needs of each.
    Errors from all files are reported together, once every file was read (a bucket that refuses or does not
    answer stops at once: no other document can be read either). `listed` collects each document's listing
    entry, taken before it is read (a later edit then shows as a newer mtime or another ETag).
    `known`: the knowledge key of a file the caller already holds as it is, else None (such files are listed,
    counted and checked for colliding keys, neither read nor yielded: `listed` names them). `files`: the source's `list_source` as the caller took it
    (a plan lists once), else listed here. `again`: a file to be read is looked at again first (its entry
    now, None: gone, so no document), for a listing partly taken from a record."""
    knowledge = as_source(docs)
    entries, errors = (files[0], list(files[1])) if files is not None else list_source(knowledge)
    by_key: dict[str, list[str]] = {}
    count = 0
    for file in entries:
        if known is not None and (key := known(file)) is not None:
            if listed is not None:
                listed[file.source] = file
            by_key.setdefault(key.casefold(), []).append(file.source)
            count += 1
            continue
        if again is not None:
            looked = again(file)
            if looked is None:
                continue
            file = looked
        try:
            data = read_bytes(knowledge, file.source, max_bytes=max_bytes, size=file.size)
            document = parse_document(PurePosixPath(file.source), file.source, data, default_tenant=default_tenant)
        except SourceRefused:
            raise
        except SourceError as exc:
            errors.append(str(exc))
            continue
        except OSError as exc:  # vanished or unreadable between listing and reading
            errors.append(f"{file.source}: cannot be read ({exc.strerror or type(exc).__name__})")
            continue
        if listed is not None:
            listed[file.source] = file
        by_key.setdefault(document.knowledge_key.casefold(), []).append(document.source)
        count += 1
        yield document
    for sources in by_key.values():
        if len(sources) > 1:
            errors.append(f"{' and '.join(spelled_apart(sources))}: map to the same knowledge_key; rename one of them")
    if errors:
        raise SourceError(f"{len(errors)} knowledge document(s) cannot be indexed:\n  " + "\n  ".join(errors))
    if not count:
        if knowledge.local:
            raise SourceError(f"knowledge folder {knowledge.uri} holds no .md documents")
        raise SourceError(f"knowledge source {knowledge.uri} holds no .md documents at {endpoint_of(knowledge.fs)}: "
                          "refused, as an empty folder is (most often a wrong prefix, not a wish to delete "
                          "everything)")


def spelled_apart(names: list[str]) -> list[str]:
    """Names that print alike (`café` composed, NFC, and `cafe` + a combining accent, NFD) with what tells
    them apart: each one's Unicode form and its code points beyond ASCII."""
    if len({unicodedata.normalize("NFC", name) for name in names}) == len(names):
        return names  # they differ visibly (in case)
    return [f"{name} ({unicode_form(name)}: {ascii(name)[1:-1]})" for name in names]


def unicode_form(name: str) -> str:
    if unicodedata.is_normalized("NFC", name):
        return "NFC, composed" if not unicodedata.is_normalized("NFD", name) else "ASCII-only or plain"
    return "NFD, decomposed" if unicodedata.is_normalized("NFD", name) else "mixed Unicode forms"


def load_corpus(docs: KnowledgeSource | Path, *, max_bytes: int = 2_000_000) -> list[Document]:
    """Every document, sorted by key. Errors from all files are reported together."""
    return sorted(iter_corpus(docs, max_bytes=max_bytes), key=lambda d: d.knowledge_key)


def corpus_fingerprint(documents: Iterable[HasContentHash]) -> str:
    """One hash for the whole corpus: equal fingerprints mean nothing to reindex."""
    digest = hashlib.sha256()
    for doc in sorted(documents, key=lambda d: d.knowledge_key):
        digest.update(f"{doc.knowledge_key}\0{doc.content_hash}\n".encode())
    return digest.hexdigest()
