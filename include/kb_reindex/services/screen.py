"""The instruction screen: which lines of a knowledge page read as addressed to the assistant rather than to the
customer.

Two passes over what `kb_reindex.domain.screen_text.passages` reads of a page (each line and short paragraph,
normalised; HTML comments, link titles and alt texts apart):
1. the patterns (`kb_reindex.domain.instructions`): what they match is flagged, by their wording;
2. a classifier by meaning over multilingual-e5-small's passage vectors (the model the project ships, offline,
   loaded once per process): logistic regression over the vector and whom the text addresses
   (`kb_reindex.domain.addressee`: the assistant called to or described, the reader called 你 or 您, answers
   ruled; since the tenth pass, 2026-12-06), averaged with a vote of the labelled lines nearest in meaning
   (`Neighbours`), its weights and those lines' vectors shipped beside this module (`screen_weights.json`,
   `screen_neighbours.npz`; retrained by bench/train_screen.py on the retired parts of bench/instructions.yaml
   and the shipped pages' passages as benign lines).

The screen's mode (`KB_INSTRUCTION_SCREEN`): `meaning` (both passes), `patterns` (the first alone: no model is
loaded), `auto` (the default: `meaning`, except with the offline `hashing` embedder, which is for tests and
trials; there the screen says once on the log that it judges by the patterns alone). The plan judges only the
documents that changed against live when live was judged by the same screen (`kb_reindex.services.corpus`), the
passages of all of them scored in one e5 call; and e5 embeds only the texts no plan scored before with these
weights: a process remembers what it scored, and the state DB keeps every score by the text's SHA-256
(`ScoreMemory`, `kb_screen_scores`), so a one-line edit embeds that line (and the short paragraph it is in).

`Screen.version` names the screen as each version records it: the patterns' digest, and in mode `meaning` the
model and the weights file's digest; a version judged by another screen is judged again in full.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from kb_reindex.domain.addressee import ADDRESSEE_CUES, ADDRESSEE_VERSION, addressee_cues
from kb_reindex.domain.errors import ConfigError
from kb_reindex.domain.instructions import INSTRUCTION_PATTERNS, NEGATED_CLAUSE, pattern_reason
from kb_reindex.domain.screen_text import NORMALISATION, Passage, letters, passages

log = logging.getLogger(__name__)

MODEL = "multilingual-e5-small"
WEIGHTS = Path(__file__).with_name("screen_weights.json")
MEANING, PATTERNS, AUTO = "meaning", "patterns", "auto"
SCREEN_MODES = (AUTO, MEANING, PATTERNS)
#: the classifier judges a text of at least this many letters (a heading of two characters says nothing to
#: anyone; the patterns still read it)
MIN_LETTERS = 4
#: texts a process remembers the classifier's score of (a plan over the same files judges them once)
_MEMORY = 200_000

#: the classifier's threshold for a sentence of a line after its first (`Passage.later`), read apart: the
#: eighteenth pass's weights scored such sentences of the fitted parts' policy lines at most 0.765, of the shipped
#: and generated pages at most 0.359, while 296 of 415 instruction lines with one scored 0.9 or more; the
#: twentieth's at most 0.897 and 0.108, and 321 of 457 at 0.9 or more; the twenty-second's at most 0.693 and 0.230,
#: and 306 of 491; the twenty-third's at most 0.727 and 0.263, and 312 of 510 (bench/README.md; the twenty-fourth's,
#: shipped, not read apart: its pages' false alarms are counted whole)
LATER_SENTENCE_THRESHOLD = 0.9
#: the patterns, the clause that negates a match (`instructions.NEGATED_CLAUSE`), the reading in front of them
#: (`screen_text.NORMALISATION`) and the later sentences' threshold: a change to any is another screen
PATTERNS_DIGEST = hashlib.sha256(("\n".join(p.pattern for p in INSTRUCTION_PATTERNS) + f"\nread:{NORMALISATION}"
                                  + f"\nnegated:{NEGATED_CLAUSE.pattern}" + f"\nlater:{LATER_SENTENCE_THRESHOLD}"
                                  ).encode("utf-8")).hexdigest()[:12]


class ScoreMemory(Protocol):
    """Classifier scores kept beyond the process (the state DB's `kb_screen_scores`), by the classifier that
    scored them (`Classifier.key`) and the SHA-256 of the text as read (`text_digest`): a text judged once by
    these weights is never embedded again, in any later run."""

    def recall_scores(self, classifier: str, digests: Sequence[str]) -> dict[str, float]: ...

    def remember_scores(self, classifier: str, scores: dict[str, float]) -> None: ...


def text_digest(read: str) -> str:
    """The key a score is kept under: SHA-256 of the normalised text the classifier read."""
    return hashlib.sha256(read.encode("utf-8")).hexdigest()


class Flag(NamedTuple):
    """A flagged line: the file's line number, the line as written, why it was flagged."""

    line: int
    text: str
    why: str


_WHERE = {"HTML comment": "in an HTML comment (no reader sees it)", "link title": "in a link title (no reader sees it)",
          "image alt text": "in an image's alt text (no reader sees it)",
          "HTML attribute": "in an HTML tag's attribute (no reader sees it)",
          "HTML tag": "in an HTML tag (no reader sees it)", "code block": "in a code block"}


@dataclass(frozen=True)
class Neighbours:
    """The labelled lines' unit e5 vectors and labels (1: addressed to the assistant): a text's vote is the
    labels of its `k` nearest, each weighted exp(cosine / temperature); it counts `weight` of the score, the
    logistic regression the rest. A style the regression's one boundary cuts badly is still near its examples."""

    vectors: Any  # numpy array, lines x the model's dimension, unit rows
    labels: Any  # numpy array of 0/1, one per line
    k: int
    temperature: float
    weight: float

    def vote(self, unit: Any) -> Any:
        import numpy as np

        similarity = unit @ self.vectors.T
        nearest = np.argpartition(-similarity, self.k - 1, axis=1)[:, :self.k]
        close = np.exp((np.take_along_axis(similarity, nearest, 1) - 1.0) / self.temperature)
        return (close * self.labels[nearest]).sum(1) / close.sum(1)


def _load_neighbours(path: Path, spec: dict[str, Any]) -> Neighbours:
    """The `neighbours` field's file beside the weights, checked against the field (one error naming it)."""
    import numpy as np

    for key, kind in (("file", str), ("sha256", str), ("k", int), ("temperature", (int, float)), ("weight", (int, float))):
        if not isinstance(spec.get(key), kind):
            raise ConfigError(f"{path}: field 'neighbours.{key}' is missing or of the wrong type")
    if spec["file"] in ("", ".", "..") or Path(spec["file"]).name != spec["file"]:
        raise ConfigError(f"{path}: field 'neighbours.file' is {spec['file']!r}: a file name beside the weights")
    where = path.with_name(spec["file"])
    try:
        raw = where.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: the instruction screen's neighbours cannot be read ({exc})") from None
    if hashlib.sha256(raw).hexdigest() != spec["sha256"]:
        raise ConfigError(f"{where}: its SHA-256 is not the one {path.name} names (retrain both together)")
    with np.load(where, allow_pickle=False) as data:
        vectors, labels = data["vectors"].astype(np.float32), data["labels"].astype(np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != 384 or labels.shape != (vectors.shape[0],) or not np.isfinite(vectors).all():
        raise ConfigError(f"{where}: 'vectors' must be lines x 384 and 'labels' one per line")
    if not (1 <= spec["k"] <= len(labels) and spec["temperature"] > 0 and 0 < spec["weight"] < 1):
        raise ConfigError(f"{path}: field 'neighbours' has k {spec['k']}, temperature {spec['temperature']}, weight "
                          f"{spec['weight']}: k must be 1..{len(labels)}, temperature > 0, weight between 0 and 1")
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return Neighbours(vectors=vectors, labels=labels, k=spec["k"], temperature=float(spec["temperature"]),
                      weight=float(spec["weight"]))


def _cue_weights(path: Path, spec: Any) -> Any:
    """The `addressee` field: the cues' weights, fitted on the cues this release reads (named and versioned)."""
    import numpy as np

    if not isinstance(spec, dict) or not isinstance(spec.get("weights"), list):
        raise ConfigError(f"{path}: field 'addressee' must be an object with a list 'weights'")
    if spec.get("version") != ADDRESSEE_VERSION or spec.get("cues") != list(ADDRESSEE_CUES):
        raise ConfigError(f"{path}: field 'addressee' was fitted on cues version {spec.get('version')!r}; this release "
                          f"reads version {ADDRESSEE_VERSION} ({len(ADDRESSEE_CUES)} cues): retrain with "
                          "`.venv/bin/python bench/train_screen.py` or set KB_INSTRUCTION_SCREEN=patterns")
    weights = np.asarray(spec["weights"], dtype=np.float32)
    if weights.shape != (len(ADDRESSEE_CUES),) or not np.isfinite(weights).all():
        raise ConfigError(f"{path}: field 'addressee.weights' must be {len(ADDRESSEE_CUES)} finite numbers "
                          f"(has {weights.size})")
    return weights


@dataclass
class Classifier:
    """sigmoid(x . weights + cues . cue_weights + bias) over a text's e5 passage vector and its addressee cues,
    averaged with its `neighbours`' vote when shipped; flagged from `threshold`."""

    weights: Any  # numpy array, the model's dimension
    bias: float
    threshold: float
    digest: str
    model: str = MODEL
    neighbours: Neighbours | None = None
    #: the weights of whom a text addresses (`kb_reindex.domain.addressee`), beside its vector's; None: not fitted
    cue_weights: Any = None
    #: texts e5 embedded for this classifier in this process (the others were remembered)
    embedded: int = 0
    _memory: dict[str, float] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> Classifier:
        """The shipped weights; a missing, unreadable or malformed file is one error naming it and the field."""
        import numpy as np

        try:
            raw = path.read_bytes()
            record = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: the instruction screen's weights cannot be read ({exc}); retrain them with "
                              "`.venv/bin/python bench/train_screen.py` or set KB_INSTRUCTION_SCREEN=patterns") from None
        for key, kind in (("model", str), ("weights", list), ("bias", (int, float)), ("threshold", (int, float))):
            if not isinstance(record.get(key), kind):
                raise ConfigError(f"{path}: field {key!r} is missing or not a {getattr(kind, '__name__', 'number')}")
        if record["model"] != MODEL:
            raise ConfigError(f"{path}: field 'model' is {record['model']!r}; the screen runs {MODEL!r}")
        weights = np.asarray(record["weights"], dtype=np.float32)
        if weights.shape != (384,) or not np.isfinite(weights).all():
            raise ConfigError(f"{path}: field 'weights' must be 384 finite numbers (has {weights.size})")
        if not 0.0 < float(record["threshold"]) < 1.0:
            raise ConfigError(f"{path}: field 'threshold' is {record['threshold']}, not between 0 and 1")
        cue_weights = None
        if record.get("addressee") is not None:
            cue_weights = _cue_weights(path, record["addressee"])
        neighbours = None
        if record.get("neighbours") is not None:
            if not isinstance(record["neighbours"], dict):
                raise ConfigError(f"{path}: field 'neighbours' must be an object")
            neighbours = _load_neighbours(path, record["neighbours"])
        # the weights file names the neighbours' SHA-256: its digest names both
        return cls(weights=weights, bias=float(record["bias"]), threshold=float(record["threshold"]),
                   digest=hashlib.sha256(raw).hexdigest()[:12], neighbours=neighbours, cue_weights=cue_weights)

    @property
    def key(self) -> str:
        """Who scored a kept score: the model and the weights file's digest."""
        return f"{self.model}-lr:{self.digest}"

    def scores(self, texts: Sequence[str], memory: ScoreMemory | None = None) -> list[float]:
        """Each text's probability of being addressed to the assistant. Looked up first in this process's
        memory, then in `memory` (scores kept by earlier runs); e5 embeds only the rest, all in one call, and
        what it scored is kept in both. `embedded` counts the texts e5 embedded."""
        from kb_reindex.services.e5 import e5_arrays  # loads the model on first use only

        with self._lock:
            known = {t: self._memory[t] for t in set(texts) if t in self._memory}
        todo = sorted(set(texts) - known.keys(), key=len)
        if todo and memory is not None:
            digests = {text_digest(t): t for t in todo}
            kept = {digests[d]: score for d, score in memory.recall_scores(self.key, list(digests)).items()
                    if d in digests}
            known.update(kept)
            self._remember(kept)
            todo = [t for t in todo if t not in kept]
        if todo:
            fresh = dict(zip(todo, self._judge(e5_arrays(todo, model=self.model), todo), strict=True))
            self.embedded += len(todo)
            known.update(fresh)
            self._remember(fresh)
            if memory is not None:
                memory.remember_scores(self.key, {text_digest(t): score for t, score in fresh.items()})
        return [known[t] for t in texts]

    def _judge(self, vectors: Any, texts: Sequence[str]) -> list[float]:
        """Each passage's score from its vector and text: the regression's probability (over the vector and
        whom the text addresses), averaged with the neighbours' vote."""
        import numpy as np

        logit = vectors @ self.weights + self.bias
        if self.cue_weights is not None:
            logit = logit + np.array([addressee_cues(t) for t in texts], dtype=np.float32) @ self.cue_weights
        probability = 1.0 / (1.0 + np.exp(-np.clip(logit, -50.0, 50.0)))
        if self.neighbours is None:
            return [float(p) for p in probability]
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        share = self.neighbours.weight
        return [float(p) for p in (1 - share) * probability + share * self.neighbours.vote(unit)]

    def _remember(self, scores: dict[str, float]) -> None:
        with self._lock:
            if len(self._memory) + len(scores) > _MEMORY:
                self._memory.clear()
            self._memory.update(scores)


@dataclass
class Screen:
    """The patterns, and in mode `meaning` the classifier after them."""

    mode: str
    classifier: Classifier | None = None
    #: documents judged by this screen in this process (the plan's cost, for the log and the bench)
    judged_documents: int = 0

    @property
    def version(self) -> str:
        if self.classifier is None:
            return f"patterns:{PATTERNS_DIGEST}"
        return f"patterns:{PATTERNS_DIGEST}+{self.classifier.model}-lr:{self.classifier.digest}"

    def to_dict(self) -> dict[str, Any]:
        """What a version records of the screen that judged it."""
        out: dict[str, Any] = {"version": self.version, "mode": self.mode, "patterns": len(INSTRUCTION_PATTERNS)}
        if self.classifier is not None:
            out.update(model=self.classifier.model, weights_sha256=self.classifier.digest,
                       threshold=self.classifier.threshold)
        return out

    def flag(self, body: str, *, first_line: int = 1, memory: ScoreMemory | None = None) -> tuple[Flag, ...]:
        """The flagged lines of a page body whose first line is line `first_line` of its file, one per line,
        in line order."""
        return self.flag_pages([passages(body, first_line=first_line)], memory=memory)[0]

    def flag_pages(self, pages: Sequence[Sequence[Passage]], memory: ScoreMemory | None = None) -> list[tuple[Flag, ...]]:
        """The flagged lines of each page (its `passages`), the classifier's texts of all of them scored in one
        call (`memory`: scores kept by earlier runs, see `Classifier.scores`)."""
        self.judged_documents += len(pages)
        reasons = [[pattern_reason(p.read) for p in found] for found in pages]
        scored: dict[str, float] = {}
        if self.classifier is not None:
            texts = sorted({p.read for found, why in zip(pages, reasons, strict=True)
                            for p, r in zip(found, why, strict=True) if r is None and letters(p.read) >= MIN_LETTERS})
            scored = dict(zip(texts, self.classifier.scores(texts, memory), strict=True))
        return [self._flags(found, why, scored) for found, why in zip(pages, reasons, strict=True)]

    def judge_lines(self, lines: Sequence[str]) -> list[tuple[Flag, ...]]:
        """Each text judged as a one-line page (the bench's labelled lines), in one classifier call."""
        return self.flag_pages([passages(line) for line in lines])

    def _flags(self, found: Sequence[Passage], reasons: Sequence[str | None], scored: dict[str, float]
               ) -> tuple[Flag, ...]:
        flags: dict[int, Flag] = {}
        paragraphs = []
        for passage, reason in zip(found, reasons, strict=True):
            score = scored.get(passage.read) if reason is None else None
            threshold = None
            if self.classifier is not None:
                threshold = self.classifier.threshold
                if passage.later:
                    threshold = max(threshold, LATER_SENTENCE_THRESHOLD)
            if reason is not None:
                why = f"matches a pattern: {reason}"
            elif score is not None and threshold is not None and score >= threshold:
                why = (f"{'a later sentence ' if passage.later else ''}reads as addressed to the assistant "
                       f"(classifier {score:.2f} >= {threshold})")
            else:
                continue
            if passage.where == "paragraph":
                paragraphs.append((passage, why))
            elif passage.line not in flags:
                where = _WHERE.get(passage.where)
                flags[passage.line] = Flag(passage.line, passage.text, f"{where}: {why}" if where else why)
        for passage, why in paragraphs:  # a paragraph none of whose lines is flagged by itself
            if not any(n in flags for n in range(passage.line, passage.line + passage.lines)):
                flags[passage.line] = Flag(passage.line, passage.text,
                                           f"read with the next {passage.lines - 1} line(s): {why}")
        return tuple(flags[n] for n in sorted(flags))


@functools.cache
def meaning_screen() -> Screen:
    """The patterns and the classifier (its weights read once per process; e5 loads at its first judgement)."""
    return Screen(MEANING, Classifier.load())


@functools.cache
def patterns_screen() -> Screen:
    return Screen(PATTERNS)


def screen_mode(configured: str, embedder: str) -> str:
    """`meaning` or `patterns`: KB_INSTRUCTION_SCREEN, `auto` resolved by the embedder (`hashing`: patterns)."""
    if configured == AUTO:
        return PATTERNS if embedder == "hashing" else MEANING
    return configured


_said_patterns_only = False


def screen_for(configured: str, embedder: str) -> Screen:
    """The screen a knowledge base's plan judges with (said once on the log when it is the patterns alone)."""
    global _said_patterns_only
    mode = screen_mode(configured, embedder)
    if mode == MEANING:
        return meaning_screen()
    if not _said_patterns_only:
        _said_patterns_only = True
        why = "KB_INSTRUCTION_SCREEN=patterns" if configured == PATTERNS else "KB_EMBEDDER=hashing"
        log.warning("kb_reindex: the instruction screen judges by its patterns alone (%s): a paraphrase, another "
                    "language or an unseen style walks past it. KB_INSTRUCTION_SCREEN=meaning adds the classifier",
                    why)
    return patterns_screen()
