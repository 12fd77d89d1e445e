"""Every served dtype's greedy tokens on the tiny fp32 Llama, through kvq_torch and kvq_triton (kvq_torch alone for the
peers' formats), equal the ones recorded in tests/data/greedy_tokens.json (scripts/greedy_tokens.py: two turns, the
second a radix hit whose extend reads packed pages with their extras). Both backends' records are equal, so each
backend compared with the record is the two compared with each other. A change meant to keep every dtype's output
runs this with KVQ_TEST_MATRIX=all (an engine per dtype and backend: over an hour on 2 cores); CI holds kivi2 (the
default dtype) to its record through both backends (about 160 s); each format's Triton reads are compared with its
reference in tests/kernels/."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from sgl_kvq.config import DTYPE_NAMES
from slices import ci_slice

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests/data/greedy_tokens.json"



def _recorder():
    spec = importlib.util.spec_from_file_location("greedy_tokens", ROOT / "scripts/greedy_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_record_covers_every_dtype_and_its_backends():
    """Both backends, or kvq_torch alone for a format without a Triton kernel (the peers')."""
    tokens = json.loads(RECORD.read_text())["tokens"]
    assert sorted(tokens) == sorted(DTYPE_NAMES)
    backends_of = _recorder().backends_of
    assert all(sorted(t) == sorted(backends_of(d)) for d, t in tokens.items())


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("dtype", ci_slice(DTYPE_NAMES, ["kivi2"]))
def test_greedy_tokens_equal_the_record(dtype):
    want = json.loads(RECORD.read_text())["tokens"][dtype]
    assert _recorder().record([dtype])[dtype] == want
