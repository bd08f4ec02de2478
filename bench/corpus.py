"""Deterministic synthetic help-centre corpus for the benchmark.

`generate(n, seed)` gives N Markdown documents (front matter, an H1, H2/H3 sections, Chinese and English
paragraphs) averaging about five chunks each under the default chunking (500 characters, overlap 50), so
500 docs ~ 2.5k chunks, 2,000 ~ 10k and 20,000 ~ 100k. `mutate()` derives the incremental scenario: 1% of
the documents get one paragraph rewritten, 0.5% are added, 0.5% are deleted. `golden_yaml()` writes a
permissive golden set (thresholds 0, regressions unbounded) whose probes come from documents no mutation
deletes, so validation does its full work but cannot fail the benchmark.

Same (n, seed) -> byte-identical files, on any machine: only `random.Random(seed)` is used.

    python bench/corpus.py --docs 500 --out /tmp/corpus     # write one to look at
"""

from __future__ import annotations

import argparse
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SEED = 20260101

CATEGORIES = ["售后", "支付", "物流", "营销", "会员", "账户", "商品", "发票", "跨境", "门店"]
ZH_SUBJECTS = ["退货申请", "退款", "换货", "优惠券", "积分", "运费", "电子发票", "会员等级", "预售定金", "礼品卡",
               "价格保护", "以旧换新", "分期付款", "上门取件", "保价服务", "赠品", "库存预占", "发货时效", "签收",
               "拒收", "地址修改", "订单取消", "评价晒单", "延保服务", "安装预约", "门店自提", "跨境商品", "关税"]
ZH_OBJECTS = ["家电", "数码配件", "生鲜", "美妆", "图书", "母婴用品", "服饰鞋包", "家具", "食品饮料", "宠物用品",
              "运动户外", "珠宝首饰", "汽车用品", "医药保健"]
ZH_TEMPLATES = [
    "{s}需要在签收后{n}天内提交，超过期限系统将不再受理。",
    "{o}类商品的{s}按照平台统一规则执行，特殊商品以商品详情页的说明为准。",
    "用户提交{s}后，客服会在{n}个工作日内完成审核并通过短信通知结果。",
    "订单金额满{m}元时，{s}可以与店铺活动叠加使用，但不能与其他平台券同时使用。",
    "如果{s}被驳回，用户可以在订单详情页补充凭证后重新提交一次。",
    "{o}在运输途中出现破损的，请在{n}小时内拍照并联系在线客服处理{s}。",
    "参加限时活动购买的{o}，{s}的金额按照实际支付金额计算。",
    "{s}完成后，原路退回的款项通常在{n}个工作日内到账，银行卡以发卡行为准。",
    "会员在每个自然月内最多可以享受{n}次免费的{s}服务。",
    "{o}的{s}不收取手续费，但需要保持商品及包装完好、配件齐全。",
    "节假日期间{s}的处理时间可能顺延{n}天，请以页面提示为准。",
    "部分偏远地区不支持{o}的{s}，下单前请在结算页确认配送范围。",
    "同一订单拆分为多个包裹发货时，{s}需要按包裹分别发起。",
    "使用{s}后如果发生部分退款，已抵扣的金额按比例退回账户。",
]
EN_TEMPLATES = [
    "Requests for {s} must be submitted within {n} days of delivery; later requests are declined automatically.",
    "Items in the {o} category follow the standard {s} policy unless the product page states otherwise.",
    "After a customer files a {s} request, support reviews it within {n} business days and replies by email.",
    "Orders over {m} yuan may combine {s} with store promotions, but not with other platform coupons.",
    "If a {s} request is rejected, the customer can add photos in the order details and resubmit once.",
    "Damage to {o} found on arrival should be photographed and reported within {n} hours for {s}.",
    "For {o} bought in a flash sale, the {s} amount is based on the price actually paid.",
    "Refunds issued through {s} usually reach the original payment method within {n} business days.",
    "Members can use the free {s} service up to {n} times per calendar month.",
    "There is no handling fee for {s} on {o}, provided the packaging and accessories are complete.",
]
EN_SUBJECTS = ["returns", "refunds", "exchanges", "coupons", "reward points", "shipping fees", "e-invoices",
               "price protection", "trade-in", "instalment payments", "doorstep pickup", "gift cards",
               "pre-order deposits", "extended warranty", "installation booking", "store pickup"]
EN_OBJECTS = ["home appliances", "electronics accessories", "fresh food", "cosmetics", "books", "baby products",
              "apparel", "furniture", "pet supplies", "sports gear", "jewellery", "car accessories"]
SECTION_ZH = ["适用范围", "办理条件", "办理流程", "费用说明", "时效要求", "特殊商品", "常见问题", "注意事项", "例外情况",
              "申请材料", "到账时间", "争议处理"]
SECTION_EN = ["Scope", "Eligibility", "How to apply", "Fees", "Time limits", "Special items", "FAQ", "Notes"]
TITLE_SUFFIX = ["规则", "说明", "指南", "政策", "须知", "办理流程"]


@dataclass
class Corpus:
    """key -> Markdown text, plus what a probe needs per document."""

    docs: dict[str, str]
    codes: dict[str, str] = field(default_factory=dict)  # key -> the rule code quoted in its intro
    next_index: int = 0

    def copy(self) -> Corpus:
        return Corpus(dict(self.docs), dict(self.codes), self.next_index)


@dataclass
class Mutation:
    edited: list[str]
    added: list[str]
    deleted: list[str]

    def summary(self) -> dict[str, int]:
        return {"edited": len(self.edited), "added": len(self.added), "deleted": len(self.deleted)}


def _sentence(rng: random.Random, english: bool) -> str:
    if english:
        return rng.choice(EN_TEMPLATES).format(s=rng.choice(EN_SUBJECTS), o=rng.choice(EN_OBJECTS),
                                               n=rng.randint(1, 30), m=rng.choice([99, 199, 299, 499, 999]))
    return rng.choice(ZH_TEMPLATES).format(s=rng.choice(ZH_SUBJECTS), o=rng.choice(ZH_OBJECTS),
                                           n=rng.randint(1, 30), m=rng.choice([99, 199, 299, 499, 999]))


def paragraph(rng: random.Random) -> str:
    """One paragraph: Chinese (about 70%) or English; a sentence per line of thought, never a heading."""
    english = rng.random() < 0.3
    count = rng.randint(2, 4) if english else rng.randint(3, 7)
    joiner = " " if english else ""
    text = joiner.join(_sentence(rng, english) for _ in range(count))
    if rng.random() < 0.15:  # a list now and then, as help pages have
        items = [f"- {_sentence(rng, english)}" for _ in range(rng.randint(2, 4))]
        text = text + "\n" + "\n".join(items)
    return text


def _document(rng: random.Random, index: int) -> tuple[str, str, str]:
    """(key, text, code) for document number `index`; the code makes a probe that finds this document."""
    subject = rng.choice(ZH_SUBJECTS)
    obj = rng.choice(ZH_OBJECTS)
    title = f"{obj}{subject}{rng.choice(TITLE_SUFFIX)}（{index:05d}）"
    code = f"R{index:05d}"
    category = rng.choice(CATEGORIES)
    parts = [
        f"---\ntitle: {title}\ncategory: {category}\ntenant: default\n---\n",
        f"# {title}\n",
        f"本页说明{obj}的{subject}，规则编号 {code}。{_sentence(rng, False)}{_sentence(rng, False)}\n",
    ]
    used: set[str] = set()
    for _ in range(rng.randint(2, 4)):
        english = rng.random() < 0.25
        heading = rng.choice(SECTION_EN if english else SECTION_ZH)
        while heading in used:
            heading = f"{heading}{len(used)}"
        used.add(heading)
        parts.append(f"## {heading}\n")
        if rng.random() < 0.2:
            parts.append(f"### {rng.choice(SECTION_ZH)}\n")
        for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
            parts.append(paragraph(rng) + "\n")
    return f"doc-{index:05d}", "\n".join(parts), code


def generate(n: int, seed: int = DEFAULT_SEED) -> Corpus:
    corpus = Corpus(docs={})
    for index in range(n):
        rng = random.Random(f"{seed}:doc:{index}")
        key, text, code = _document(rng, index)
        corpus.docs[key] = text
        corpus.codes[key] = code
    corpus.next_index = n
    return corpus


def _count(n: int, share: float) -> int:
    return max(1, int(n * share + 0.5))


def mutate(corpus: Corpus, seed: int = DEFAULT_SEED, *, edit: float = 0.01, add: float = 0.005,
           delete: float = 0.005) -> tuple[Corpus, Mutation]:
    """The incremental scenario: rewrite one body paragraph of `edit` of the docs, add and delete some."""
    rng = random.Random(f"{seed}:mutate:{len(corpus.docs)}")
    keys = sorted(corpus.docs)
    n = len(keys)
    chosen = rng.sample(keys, _count(n, edit) + _count(n, delete))
    edited, deleted = sorted(chosen[: _count(n, edit)]), sorted(chosen[_count(n, edit):])
    new = corpus.copy()
    for key in edited:
        new.docs[key] = edit_one_paragraph(new.docs[key], random.Random(f"{seed}:edit:{key}"))
    for key in deleted:
        del new.docs[key]
        new.codes.pop(key, None)
    added = []
    for _ in range(_count(n, add)):
        index = new.next_index
        new.next_index += 1
        key, text, code = _document(random.Random(f"{seed}:doc:{index}"), index)
        new.docs[key] = text
        new.codes[key] = code
        added.append(key)
    return new, Mutation(edited=edited, added=sorted(added), deleted=deleted)


def edit_one_paragraph(text: str, rng: random.Random) -> str:
    """Replace one body paragraph (not the intro with the rule code, not a heading) with a new one."""
    blocks = text.split("\n\n")
    candidates = [i for i, b in enumerate(blocks) if b.strip() and not b.lstrip().startswith(("#", "---", "本页说明"))]
    target = rng.choice(candidates)
    blocks[target] = paragraph(rng)
    return "\n\n".join(blocks)


def write(corpus: Corpus, docs_dir: Path) -> None:
    """Make `docs_dir` hold exactly this corpus (files written only when their bytes differ)."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    wanted = {f"{k}.md": v for k, v in corpus.docs.items()}
    for path in docs_dir.glob("*.md"):
        if path.name not in wanted:
            path.unlink()
    for name, text in wanted.items():
        path = docs_dir / name
        data = text.encode("utf-8")
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)


def mirror(src_dir: Path, docs_dir: Path) -> None:
    """Make `docs_dir` hold exactly the files of `src_dir`: switches a worker to a corpus written
    earlier, so the worker need not keep the corpus in memory while it is measured."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    wanted = {path.name: path for path in src_dir.glob("*.md")}
    for path in docs_dir.glob("*.md"):
        if path.name not in wanted:
            path.unlink()
    for name, source in wanted.items():
        data, path = source.read_bytes(), docs_dir / name
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)


def golden_yaml(corpus: Corpus, mutation: Mutation | None, *, probes: int = 20, k: int = 4) -> str:
    """A permissive golden set: real probes (a question quoting a document's rule code), thresholds 0."""
    import yaml

    excluded = set(mutation.deleted if mutation else ())
    keys = [key for key in sorted(corpus.docs) if key not in excluded]
    step = max(1, len(keys) // probes)
    chosen = keys[::step][:probes]
    data = {
        "k": k,
        "min_hit_rate": 0.0,
        "min_mrr": 0.0,
        "max_regressions": len(chosen),
        # the sharper gates measured but never deciding: a category may lose everything, and a sign test
        # could reach this p only with thousands of probes
        "max_category_drop": 1.0,
        "paired_alpha": 1e-12,
        # the routine run deletes 0.5% of the documents on purpose: approved here, never held for a person
        "max_docs_removed": len(keys),
        "max_shrink": 1.0,
        "probes": [{"id": f"probe-{key}", "query": f"规则编号 {corpus.codes[key]} 适用于哪些情况？", "expected": [key]}
                   for key in chosen],
    }
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def write_project(root: Path, corpus: Corpus, mutation: Mutation | None) -> Path:
    """A kb-reindex project root: knowledge/docs/*.md and knowledge/golden.yaml."""
    if root.exists():
        shutil.rmtree(root)
    write(corpus, root / "knowledge" / "docs")
    (root / "knowledge" / "golden.yaml").write_text(golden_yaml(corpus, mutation), encoding="utf-8")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=500)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mutated", action="store_true", help="write the corpus after the incremental edit")
    args = parser.parse_args(argv)
    corpus = generate(args.docs, args.seed)
    mutation = None
    if args.mutated:
        corpus, mutation = mutate(corpus, args.seed)
    write_project(args.out, corpus, mutation)
    print(f"{len(corpus.docs)} documents in {args.out / 'knowledge' / 'docs'}"
          + (f"; mutation {mutation.summary()}" if mutation else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
