"""`sgl-kvq eval longdoc`: its facts and documents offline, and one run through the engine on the tiny Llama."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from bench.commands import eval_longdoc
from bench.eval import engine_eval as ee
from bench.eval import longdoc as ld
from slices import matrix_only


def _documents(length: int):
    from bench import models

    tok = ee.tokenizer(models.tiny_llama())
    return tok, eval_longdoc.Documents(tok, length)


def test_halves_hold_two_facts_of_every_kind_and_share_none():
    choose, report = ld.HALVES["choose"], ld.HALVES["report"]
    assert not set(choose) & set(report) and set(choose) | set(report) == set(ld.FACTS)
    kinds = {"code", "name", "phrase", "multikey", "split"}
    assert Counter(f.kind for f in choose) == Counter(f.kind for f in report) == {k: 2 for k in kinds}
    for f in ld.FACTS:  # the answer follows the prefix the assistant turn starts with, in the fact's first sentence
        first = f.sentences[0]
        assert first.startswith(f.answer_prefix) and f.answers[0].lower() in first[len(f.answer_prefix):].lower()
        if f.kind == "split":
            assert f.answers[1].lower() in f.sentences[1].lower()
        if f.kind == "multikey":  # the distractors differ in the key and the value
            assert all(f.answers[0] not in d for d in f.sentences[1:])


def test_depths_are_a_permutation_that_moves_every_sentence_between_lengths():
    n = len(ld.sentences())
    per_length = [ld.depths(n, j) for j in range(3)]
    for d in per_length:
        assert sorted(d) == sorted(per_length[0]) and len(set(d)) == n and 0 < min(d) and max(d) < 1
    assert all(len({d[i] for d in per_length}) == 3 for i in range(n))


def test_a_hit_needs_every_answer_in_order():
    split = next(f for f in ld.FACTS if f.kind == "split")
    assert ld.hit(split, " RIVER and the second half is STONE.")
    assert not ld.hit(split, " STONE, then RIVER") and not ld.hit(split, " RIVER")
    code = ld.FACTS[0]
    assert ld.hit(code, " 47-19-83.") and not ld.hit(code, " 47-19-38")


def test_the_document_is_a_prefix_with_every_sentence_planted_at_its_depth():
    tok, docs = _documents(2048)
    reserve = 64
    doc, where = docs.document(2048, 1, reserve)
    assert len(doc) == 2048 - reserve and doc[:len(docs.head)] == docs.head
    planted = sum(map(len, docs.planted))
    text = len(doc) - len(docs.head) - planted
    for sentence, ids, depth in zip(ld.sentences(), docs.planted, ld.depths(len(docs.planted), 1)):
        at = where[sentence]
        assert doc[at:at + len(ids)] == ids
        # at its depth of the essay text, or up to 200 text tokens earlier (a sentence start), plus the planted
        # sentences before it
        assert int(depth * text) - 200 <= at - len(docs.head) <= int(depth * text) + planted
    with pytest.raises(SystemExit, match="leaves"):
        docs.document(300, 0, reserve)


@pytest.mark.slow
@pytest.mark.engine
@matrix_only("a measurement run (`sgl-kvq eval longdoc`, ~80 s); its parts are checked offline above")
def test_every_question_reads_the_document_from_the_cache(tmp_path):
    out = tmp_path / "longdoc.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "eval", "longdoc", "--model", "tiny",
                           "--max-running-requests", "4", "--kv-cache-dtype", "auto,kivi2", "--lengths", "1024,1536",
                           "--max-new-tokens", "4", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["settings"]["max_total_tokens"] == 1536 + eval_longdoc.POOL_MARGIN
    rows = {r["kv_cache_dtype"]: r for r in res["results"]}
    for dt, r in rows.items():
        assert r["questions_asked"] == 2 * len(ld.HALVES["report"]), dt
        assert [p["length"] for p in r["prefills"]] == [1024, 1536]
        doc_tokens = {p["length"]: p["document_tokens"] for p in r["prefills"]}
        for q in r["questions"]:
            # every complete 64-token page of the document came from the radix cache
            assert doc_tokens[q["length"]] // 64 * 64 <= q["cached_tokens"] and q["half"] == "report", (dt, q)
    # scored against bf16 in the same run: bf16 answers all of its own hits
    for n in ("1024", "1536"):
        v = rows["auto"]["vs_bf16"][n]
        assert v["also_hit"] == v["bf16_hits"] == rows["auto"]["hits_by_length"][n]
