from __future__ import annotations

from kb_reindex.services.chunking import chunk_document, chunking_version, point_id_for
from kb_reindex.services.sources import Document, sha256_text


def doc(body: str, *, title: str = "退换货政策", key: str = "return-policy") -> Document:
    return Document(knowledge_key=key, source=f"{key}.md", title=title, category="售后", tenant="default",
                    body=body, content_hash=sha256_text(body))


LONG_PARAGRAPH = "".join(f"第{i}条规则说明商品在签收后的处理方式，需要保留完整包装和发票。" for i in range(1, 40))


def test_sections_are_split_by_heading_and_carry_their_path() -> None:
    chunks = chunk_document(doc("# 退换货政策\n\n## 退货时限\n签收后7天内可退。\n\n### 特殊商品\n生鲜不退。\n\n## 运费\n买家承担。"))
    assert [c.section for c in chunks] == ["退货时限", "退货时限 > 特殊商品", "运费"]
    assert chunks[1].text.startswith("退换货政策 > 退货时限 > 特殊商品\n")
    assert [c.chunk_index for c in chunks] == [0, 1, 2]


def test_an_h1_that_differs_from_the_title_is_indexed_in_every_chunk_of_its_sections() -> None:
    body = "# 七天无理由退货说明\n\n开头说明。\n\n## 退货时限\n签收后7天内可退。"
    chunks = chunk_document(doc(body, title="退换货政策"))
    assert [c.section for c in chunks] == ["七天无理由退货说明", "七天无理由退货说明 > 退货时限"]
    assert all(c.text.startswith("退换货政策 > 七天无理由退货说明") for c in chunks)


def test_an_h1_equal_to_the_title_is_not_repeated_so_its_chunks_keep_their_hashes() -> None:
    chunks = chunk_document(doc("# 退换货政策\n\n开头说明。\n\n## 退货时限\n签收后7天内可退。"))
    assert [c.text for c in chunks] == ["退换货政策\n开头说明。", "退换货政策 > 退货时限\n签收后7天内可退。"]


def test_long_paragraph_is_cut_at_chinese_sentence_ends_within_size() -> None:
    chunks = chunk_document(doc(f"## 规则\n{LONG_PARAGRAPH}"), chunk_size=200, overlap=30)
    assert len(chunks) > 3
    for chunk in chunks:
        assert len(chunk.text) <= 200
        body = chunk.text.split("\n", 1)[1]
        assert body.endswith("。"), body[-10:]


def test_neighbouring_chunks_overlap_by_whole_sentences() -> None:
    chunks = chunk_document(doc(f"## 规则\n{LONG_PARAGRAPH}"), chunk_size=200, overlap=40)
    for first, second in zip(chunks, chunks[1:], strict=False):
        last_sentence = first.text.rstrip("。").rsplit("。", 1)[-1] + "。"
        assert second.text.split("\n", 1)[1].startswith(last_sentence)
        assert len(last_sentence) <= 40


def test_no_overlap_when_overlap_is_zero() -> None:
    chunks = chunk_document(doc(f"## 规则\n{LONG_PARAGRAPH}"), chunk_size=200, overlap=0)
    bodies = [c.text.split("\n", 1)[1] for c in chunks]
    assert "".join(bodies).replace("\n", "") == LONG_PARAGRAPH


def test_a_sentence_longer_than_the_chunk_is_hard_split() -> None:
    chunks = chunk_document(doc("## 长句\n" + "无标点的长文本" * 200), chunk_size=120, overlap=0)
    assert all(len(c.text) <= 120 for c in chunks)
    assert sum(len(c.text.split("\n", 1)[1]) for c in chunks) == len("无标点的长文本" * 200)


def test_headings_inside_code_fences_are_not_sections() -> None:
    chunks = chunk_document(doc("## 示例\n```\n# not a heading\n```\n说明。"))
    assert len(chunks) == 1 and "# not a heading" in chunks[0].text


def test_point_ids_are_stable_and_depend_on_key_index_and_hash() -> None:
    a = point_id_for("return-policy", 0, "abc")
    assert a == point_id_for("return-policy", 0, "abc")
    assert len({a, point_id_for("return-policy", 1, "abc"), point_id_for("shipping", 0, "abc"),
                point_id_for("return-policy", 0, "abd")}) == 4
    first = chunk_document(doc("## A\n甲。\n\n## B\n乙。"))
    again = chunk_document(doc("## A\n甲。\n\n## B\n乙。"))
    assert [c.point_id for c in first] == [c.point_id for c in again]


def test_editing_one_section_changes_only_its_chunks() -> None:
    before = chunk_document(doc("## A\n甲规则。\n\n## B\n乙规则。\n\n## C\n丙规则。"))
    after = chunk_document(doc("## A\n甲规则。\n\n## B\n乙规则已修改。\n\n## C\n丙规则。"))
    assert [b.chunk_hash == a.chunk_hash for b, a in zip(before, after, strict=True)] == [True, False, True]


def test_chunking_version_names_its_parameters() -> None:
    assert chunking_version(500, 50) != chunking_version(400, 50)
    assert "500" in chunking_version(500, 50)


def test_split_sentences_keep_their_spaces_and_line_breaks() -> None:
    body = "Returns are accepted within 7 days. Items must be unused and in the original box.\n- first item line\n- second item line"
    chunks = chunk_document(doc(f"## Rules\n{body}", title="Returns"), chunk_size=80, overlap=0)
    assert len(chunks) > 1
    assert "".join(c.text.split("\n", 1)[1] for c in chunks).replace(" ", "").replace("\n", "") == body.replace(" ", "").replace("\n", "")
    assert any("within 7 days. " in c.text or c.text.endswith("within 7 days.") for c in chunks)
    assert all("days.Items" not in c.text and "line- second" not in c.text for c in chunks)
