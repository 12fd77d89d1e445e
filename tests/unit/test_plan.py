"""sgl_kvq/plan.py: the plan vocabulary holds only types (no builder, no allocation, nothing of the package
imported), and a PagedPlan's lengths are read off its two page lists."""

from __future__ import annotations

import ast
import inspect

import torch

from sgl_kvq import plan
from sgl_kvq.plan import DecodePlan, LayerKV, PagedPlan, Step


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def test_plan_imports_only_what_types_need():
    tree = ast.parse(inspect.getsource(plan))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "dataclasses", "typing", "torch"}
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not calls & {"zeros", "empty", "full", "tensor", "arange"}, "plan.py allocates"


def test_a_paged_plans_lengths_come_from_its_page_lists():
    G = 16
    p = PagedPlan(kv_indptr=_i32([0, 3, 3, 4]), kv_indices=_i32([5, 6, 7, 9]), kv_last_page_len=_i32([16, 16, 7]),
                  ov_indptr=_i32([0, 1, 3, 3]), ov_indices=_i32([2, 4, 5]), ov_last_page_len=_i32([9, 3, 0]))
    assert p.batch_size == 3
    # request 0: three whole base pages, then a frame of 9; request 1: two frames, the last of 3 tokens;
    # request 2: one partial base page of 7 tokens, no frame
    assert [p.base_len(b, G) for b in range(3)] == [48, 0, 7]
    assert [p.overlay_len(b, G) for b in range(3)] == [9, 19, 0]
    assert [p.seq_len(b, G) for b in range(3)] == [57, 19, 7]


def test_a_layer_view_is_as_wide_as_its_frames_and_a_decode_plan_as_its_splits():
    frames = torch.zeros(4, 32, 2, 8)
    codes = torch.zeros(128, 2, 2, dtype=torch.uint8)
    kv = LayerKV(codes, None, None, codes, None, None, frames, frames, k_bits=2, v_bits=2)
    assert kv.G == 32 and kv.extras is None
    empty = _i32([0])
    paged = PagedPlan(empty, _i32([]), _i32([]), empty, _i32([]), _i32([]))
    decode = DecodePlan(paged, num_splits=_i32([1, 3]), max_splits=3, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                        page_size=32, o_partial=torch.zeros(2, 4, 3, 8), lse_partial=torch.zeros(2, 4, 3))
    assert decode.batch_size == 2 and paged.batch_size == 0
    step = Step(plan=paged)
    assert step.write is None and step.rows is None and step.qo_indptr is None and step.max_qo_len == 1
