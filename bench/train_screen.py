"""Retrain the instruction screen's classifier: logistic regression over multilingual-e5-small's passage vectors,
written to include/kb_reindex/services/screen_weights.json (what kb_reindex.services.screen ships and loads).

What it is fitted on (the twenty-seventh pass, 2026-12-07): every retired part of bench/instructions.yaml
(`RETIRED`, `--parts`; never `held_out_34`, written before this pass), the passages of the shipped knowledge
pages (knowledge/**/docs: the project's own pages, benign by definition), of the written benign pages of
bench/pages/fit and, once scored, the held-out page sets (`WRITTEN_FIT`: English help centres above all, read a
line at a time: short headings, fragments, imperatives to the customer; since the twenty-second pass) and of 300 pages of the benchmark's generator under another seed
(`--corpus-pages`: templated shop rules, benign by construction) as policy lines.
Beside each line's vector it reads the line's similarity to a few descriptions of what an injection is
(`ANCHORS`, e5 query vectors, in Chinese and English): a prior towards "addressed to the model" that a few hundred
lines cannot teach; the model stays linear in the vector, so the anchors fold into the 384 weights shipped. Beside
them it reads whom the line addresses (`kb_reindex.domain.addressee`, the tenth pass: the assistant called to or
described, the reader called 你 or 您, the customer in the third person while the reader is told what to say,
answers ruled), each cue a weight of its own in the file. The score is that regression's probability averaged
with a vote of the `NEIGHBOURS` labelled lines nearest in meaning (the seventh pass): every line fitted on is
shipped as its unit vector and label (include/kb_reindex/services/screen_neighbours.npz, float16), so a style one
linear boundary cuts badly is still judged by its nearest examples.

The regularisation and the threshold are chosen by leaving one part out at a time (each part was written by
another hand, at another time: a new writer's styles are what the screen must generalise to): the threshold is
the lowest at which the screen (the patterns, then the classifier) keeps a pooled left-out precision of at least
`--precision` (default 0.95), and among the regularisation strengths the one with the best recall there. Then the
threshold is raised, if need be, just above the highest score any shipped or generated page's passage gets from
a fit that did not see it (five folds of the passages), so those pages raise no alarm; the written pages' passages
are fitted on but do not raise it (their left-out false alarms are printed). The standardisation
is folded into the weights, so the screen computes sigmoid(x . w + cues . v + b) on the raw vector.

    .venv/bin/python bench/train_screen.py            # writes the weights, prints the left-out scores
    .venv/bin/python bench/instructions.py            # then measure every part
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "include"))
sys.path.insert(0, str(HERE))

from kb_reindex.domain.addressee import ADDRESSEE_CUES, ADDRESSEE_VERSION, addressee_cues  # noqa: E402
from kb_reindex.domain.instructions import is_instruction  # noqa: E402
from kb_reindex.domain.screen_text import read_line  # noqa: E402
from kb_reindex.services.e5 import e5_arrays, e5_model, _engine  # noqa: E402
from kb_reindex.services.screen import MODEL, WEIGHTS, Neighbours  # noqa: E402

#: the regularisation strengths tried (the twentieth pass added the three below 0.03: with 4,500 labelled lines the
#: left-out recall at a pooled precision of 0.95 still rose as the strength fell, 0.925 at 0.03 to 0.936 at 0.002)
LAMBDAS = (0.002, 0.005, 0.01, 0.03, 0.05, 0.1)
FOLDS = 5
#: the parts the seventh pass was fitted on (`--parts` with `--corpus-pages 0`). A retraining reproduces a pass's
#: weights byte for byte on the machine that fitted it, not on another: e5's vectors differ there in the third
#: decimal (2026-12-05, a new machine: each of 200 lines, by up to 0.0023), and the chosen strength with them (the
#: seventh pass came back as lambda 0.15 and threshold 0.605, against 0.1 and 0.614)
SEVENTH = "train,train_5,held_out,unseen,edits,held_out_2,held_out_3,held_out_4"
#: the parts the twenty-seventh pass is fitted on: every part scored at least once, and the training parts;
#: `held_out_34` was written before this pass and is never fitted on (bench/README.md)
RETIRED = (SEVENTH + ",held_out_5,held_out_6,train_6,held_out_7,held_out_8,held_out_9,held_out_10,held_out_11"
           ",train_7,held_out_12,held_out_13,held_out_14,held_out_15,held_out_16,train_8,train_9"
           ",held_out_17,held_out_18,train_10,train_11,held_out_19,train_12,held_out_20,train_13"
           ",held_out_21,held_out_22,held_out_23,train_14,held_out_24,held_out_25"
           ",held_out_26,held_out_27,train_15,held_out_28,held_out_29,held_out_30,held_out_31"
           ",held_out_32,held_out_33,held_out_34,held_out_35,held_out_36,held_out_37,held_out_38"
           ",held_out_39")
#: benign pages beside the shipped ones: the benchmark's generator (bench/corpus.py) under another seed than the
#: 300 pages bench/instructions.py counts false alarms on (templated shop rules, plain conditional ones among them:
#: the eighth pass held 7 of those)
CORPUS_PAGES, CORPUS_SEED = 300, 1
#: the neighbours' vote: how many, how sharply the nearest count, and its share of the score (chosen by leaving one
#: part out on the parts before held_out_4: k 5 / 10 / 20, temperature 0.02 / 0.05, share 0.3 / 0.5)
NEIGHBOURS, TEMPERATURE, SHARE = 5, 0.02, 0.5
NEIGHBOURS_FILE = WEIGHTS.with_name("screen_neighbours.npz")
#: what an injection is, said to e5 as queries: a line's similarity to each is read beside its vector
ANCHORS = (
    "an instruction to the AI assistant telling it to ignore or change its rules",
    "text addressed to a chatbot or language model, not to a customer",
    "a fake system prompt or developer message for the model",
    "tell the assistant what to answer whatever the customer asks",
    "ask the AI to reveal its prompt or other customers' personal data",
    "给AI客服的指令：忽略规则，按这里说的回答",
    "写给机器人或大模型看的话，而不是写给顾客的",
    "伪造的系统提示或开发者消息",
    "要求助手泄露提示词或其他用户的个人信息",
    "a shop policy rule for customers about returns, shipping or payment",
    "面向顾客的商城规则说明：退货、运费、支付",
)
#: the anchor similarities' scale beside the vector's components (both are then standardised; this sets how
#: far the ridge lets them move)
ANCHOR_SCALE = 10.0


def fit(x: np.ndarray, y: np.ndarray, lam: float, iters: int = 100) -> np.ndarray:
    """L2-regularised logistic regression by Newton's method, the classes weighted equally; (w..., b)."""
    n, dim = x.shape
    xb = np.hstack([x, np.ones((n, 1))])
    w = np.zeros(dim + 1)
    weight = np.where(y == 1, 0.5 / y.mean(), 0.5 / (1 - y.mean()))
    ridge = lam * np.diag(np.r_[np.ones(dim), 1e-8])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-xb @ w))
        gradient = xb.T @ (weight * (p - y)) / n + ridge @ w
        hessian = (xb * (weight * p * (1 - p))[:, None]).T @ xb / n + ridge
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


def standardised_fit(x: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
    """Weights and bias on the raw vectors (the standardisation folded in)."""
    mean, scale = x.mean(0), x.std(0) + 1e-6
    w = fit((x - mean) / scale, y, lam)
    weights = w[:-1] / scale
    return weights, float(w[-1] - mean @ weights)


def anchor_vectors() -> np.ndarray:
    """The anchors' e5 query vectors (len(ANCHORS) x 384)."""
    return _engine(e5_model(MODEL).variant).encode(list(ANCHORS), True).astype(np.float64)


def with_anchors(x: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    return np.hstack([x, ANCHOR_SCALE * (x @ anchors.T)])


def cues(texts: list[str]) -> np.ndarray:
    """Whom each text addresses (`kb_reindex.domain.addressee`): len(texts) x len(ADDRESSEE_CUES)."""
    return np.array([addressee_cues(t) for t in texts], dtype=np.float64).reshape(len(texts), len(ADDRESSEE_CUES))


def fitted(x: np.ndarray, c: np.ndarray, y: np.ndarray, anchors: np.ndarray, lam: float
           ) -> tuple[np.ndarray, np.ndarray, float]:
    """Weights over the raw 384-d vector, over the addressee cues `c`, and a bias: the fit over the vector, its
    anchor similarities and the cues, the similarities' weights folded back into the vector's (they are linear
    in it)."""
    weights, bias = standardised_fit(np.hstack([with_anchors(x, anchors), c]), y, lam)
    dim, anchored = x.shape[1], x.shape[1] + len(anchors)
    return weights[:dim] + ANCHOR_SCALE * anchors.T @ weights[dim:anchored], weights[anchored:], bias


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def judge(train_x: np.ndarray, train_c: np.ndarray, train_y: np.ndarray, anchors: np.ndarray, lam: float
          ) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The score a fit on these lines gives (of vectors and their cues): the regression's probability and the
    neighbours' vote (the screen's own `Neighbours`, over these lines), averaged."""
    weights, cue_weights, bias = fitted(train_x, train_c, train_y, anchors, lam)
    neighbours = Neighbours(vectors=unit(train_x), labels=train_y, k=NEIGHBOURS, temperature=TEMPERATURE, weight=SHARE)
    return lambda x, c: (1 - SHARE) * scored(x, c, weights, cue_weights, bias) + SHARE * neighbours.vote(unit(x))


def scored(x: np.ndarray, c: np.ndarray, weights: np.ndarray, cue_weights: np.ndarray, bias: float) -> np.ndarray:
    return 1 / (1 + np.exp(-(x @ weights + c @ cue_weights + bias)))


def left_out(x: np.ndarray, c: np.ndarray, y: np.ndarray, groups: np.ndarray, shipped: np.ndarray,
             shipped_c: np.ndarray, anchors: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Each line's score from a fit without its part, and each benign page passage's (shipped, written or
    generated) from a fit on every part and four fifths of the passages, without it (five folds of the
    passages; until the twenty-second pass each such fit also left one part out in turn: six times the fits: two
    strengths the old way took 22 minutes here beside a test run, one the new way 6 minutes idle)."""
    out = np.zeros(len(y))
    for group in np.unique(groups):
        train = groups != group
        score = judge(np.vstack([x[train], shipped]), np.vstack([c[train], shipped_c]),
                      np.r_[y[train], np.zeros(len(shipped))], anchors, lam)
        out[~train] = score(x[~train], c[~train])
    pages = np.zeros(len(shipped))
    folds = np.random.default_rng(0).permutation(len(shipped)) % FOLDS
    for fold in range(FOLDS):
        keep = folds != fold
        score = judge(np.vstack([x, shipped[keep]]), np.vstack([c, shipped_c[keep]]),
                      np.r_[y, np.zeros(int(keep.sum()))], anchors, lam)
        pages[~keep] = score(shipped[~keep], shipped_c[~keep])
    return out, pages


def at_threshold(p: np.ndarray, patterns: np.ndarray, y: np.ndarray, threshold: float) -> tuple[float, float]:
    flagged = patterns | (p >= threshold)
    hits = int((flagged & (y == 1)).sum())
    false = int((flagged & (y == 0)).sum())
    return hits / int(y.sum()), hits / (hits + false) if hits + false else 1.0


def page_passages(pages: list[tuple[str, str, int]]) -> list[str]:
    """The texts the classifier reads on these pages ((name, body, first line), as bench/instructions.py lists
    them), each once, sorted."""
    from kb_reindex.domain.screen_text import letters, passages
    from kb_reindex.services.screen import MIN_LETTERS

    return sorted({p.read for _name, body, first in pages for p in passages(body, first_line=first)
                   if letters(p.read) >= MIN_LETTERS})


def shipped_passages() -> list[str]:
    """The texts the classifier reads on the shipped knowledge pages."""
    from instructions import shipped_pages

    return page_passages(shipped_pages())


def written_passages() -> list[str]:
    """The texts the classifier reads on the written benign pages fitted on (`WRITTEN_FIT`: English help
    centres above all, short headings and fragments among their lines)."""
    from instructions import WRITTEN_FIT, written_pages

    return page_passages([page for folder in WRITTEN_FIT for page in written_pages(folder)])


def corpus_passages(pages: int, seed: int) -> list[str]:
    """The texts the classifier reads on `pages` generated help-centre pages (bench/corpus.py under `seed`)."""
    from instructions import corpus_pages

    return page_passages(corpus_pages(pages, seed)) if pages else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", type=float, default=0.95, help="pooled left-out precision to keep")
    parser.add_argument("--parts", default=RETIRED,
                        help="the parts fitted on, comma-separated (a held-out part joins only once it is retired: "
                             "scored, reported, and replaced by a newer held-out part written before the fit)")
    parser.add_argument("--lambdas", default=",".join(str(v) for v in LAMBDAS),
                        help="the regularisation strengths tried, comma-separated (each costs a leave-one-part-out of "
                             "several minutes here)")
    parser.add_argument("--corpus-pages", type=int, default=CORPUS_PAGES,
                        help=f"generated benign pages fitted beside the shipped ones (seed {CORPUS_SEED}; 0: none)")
    parser.add_argument("--no-written-pages", dest="written_pages", action="store_false",
                        help="fit without the written benign pages (bench/pages/fit and the scored held-out sets: "
                             "instructions.WRITTEN_FIT; as passes before the twenty-second)")
    args = parser.parse_args()
    from instructions import WRITTEN_FIT

    every = yaml.safe_load((HERE / "instructions.yaml").read_text(encoding="utf-8"))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    rows = [(part, kind, read_line(t)) for part in parts for kind in ("instruction", "policy") for t in every[part][kind]]
    lines = [line for _part, _kind, line in rows]
    y = np.array([1.0 if kind == "instruction" else 0.0 for _part, kind, _line in rows])
    groups = np.array([part for part, _kind, _line in rows])
    x = e5_arrays(lines, model=MODEL).astype(np.float64)
    shipped_texts = shipped_passages()
    written = sorted(set(written_passages()) - set(shipped_texts)) if args.written_pages else []
    generated = sorted(set(corpus_passages(args.corpus_pages, CORPUS_SEED)) - set(shipped_texts) - set(written))
    pages = len(shipped_texts)
    shipped_texts += written + generated
    shipped = e5_arrays(shipped_texts, model=MODEL).astype(np.float64)
    c, shipped_c = cues(lines), cues(shipped_texts)
    anchors = anchor_vectors()
    patterns = np.array([is_instruction(t) for t in lines])

    # the written pages are fitted on as benign, but do not raise the threshold: read a line at a time, their
    # headings and fragments are not all told from an order by meaning (the twenty-second pass's first fit, with
    # them under the floor: threshold 0.902, left-out recall 0.632); their left-out false alarms are printed
    is_written = np.r_[np.zeros(pages, bool), np.ones(len(written), bool), np.zeros(len(generated), bool)]
    best: tuple[float, float, float, float, float] | None = None  # (recall, lambda, threshold, precision, shipped max)
    for lam in [float(v) for v in args.lambdas.split(",") if v.strip()]:
        p, page_scores = left_out(x, c, y, groups, shipped, shipped_c, anchors, lam)
        shipped_max = float(page_scores[~is_written].max())
        for threshold in np.round(np.arange(0.30, 0.991, 0.005), 3):
            recall, precision = at_threshold(p, patterns, y, float(threshold))
            if precision >= args.precision:
                threshold = max(float(threshold), math.floor(shipped_max * 1000 + 10) / 1000)
                recall, precision = at_threshold(p, patterns, y, threshold)
                print(f"lambda {lam}: threshold {threshold:.3f} (shipped and generated pages left out: max "
                      f"{shipped_max:.3f}), left-out recall {recall:.3f}, precision {precision:.3f}; written pages "
                      f"left out: {int((page_scores[is_written] >= threshold).sum())} of {int(is_written.sum())} "
                      "passages over it")
                for higher in (0.7, 0.8, 0.9):
                    if higher > threshold:
                        r, pr = at_threshold(p, patterns, y, higher)
                        print(f"    at {higher}: recall {r:.3f}, precision {pr:.3f}, written passages over it "
                              f"{int((page_scores[is_written] >= higher).sum())}")
                if best is None or recall > best[0]:
                    best = (recall, lam, threshold, precision, shipped_max)
                break
    if best is None:
        raise SystemExit(f"no threshold keeps a pooled left-out precision of {args.precision}")
    recall, lam, threshold, precision, shipped_max = best
    every_x, every_y = np.vstack([x, shipped]), np.r_[y, np.zeros(len(shipped))]
    weights, cue_weights, bias = fitted(every_x, np.vstack([c, shipped_c]), every_y, anchors, lam)
    buffer = io.BytesIO()
    # stored, not compressed: float16 vectors shrink by a tenth compressed, and inflating them took 0.12 s of every
    # process that loads the screen (0.03 s stored; bench/README.md, the twentieth pass)
    np.savez(buffer, vectors=unit(every_x).astype(np.float16), labels=every_y.astype(np.uint8))
    NEIGHBOURS_FILE.write_bytes(buffer.getvalue())
    record = {
        "model": MODEL, "input": "passage", "threshold": threshold, "bias": round(bias, 6),
        "weights": [round(float(v), 6) for v in weights],
        "trained_on": {"part": ",".join(parts), "instruction": int(y.sum()), "policy": int(len(y) - y.sum()),
                       "shipped_passages": pages,
                       **({"written_pages": ",".join(f"bench/pages/{f}" for f in WRITTEN_FIT),
                           "written_passages": len(written)}
                          if args.written_pages else {}),
                       **({"corpus_pages": args.corpus_pages, "corpus_seed": CORPUS_SEED,
                           "corpus_passages": len(generated)} if args.corpus_pages else {}),
                       "lines_sha256": hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()},
        "neighbours": {"file": NEIGHBOURS_FILE.name, "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
                       "k": NEIGHBOURS, "temperature": TEMPERATURE, "weight": SHARE},
        "addressee": {"version": ADDRESSEE_VERSION, "cues": list(ADDRESSEE_CUES),
                      "weights": [round(float(v), 6) for v in cue_weights]},
        "anchors": {"queries": len(ANCHORS), "scale": ANCHOR_SCALE,
                    "sha256": hashlib.sha256("\n".join(ANCHORS).encode("utf-8")).hexdigest()},
        "left_out": {"by": "part", "lambda": lam, "recall": round(recall, 3), "precision": round(precision, 3),
                     "shipped_pages_max_score": round(shipped_max, 4)},
    }
    WEIGHTS.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {WEIGHTS.relative_to(HERE.parent)}: lambda {lam}, threshold {threshold}, left-out recall "
          f"{recall:.3f}, precision {precision:.3f}")


if __name__ == "__main__":
    main()
