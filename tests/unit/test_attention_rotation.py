"""KVQ_ROTATE (sgl_kvq/attention_rotation.py) on kvq_torch, driven the way SGLang drives a backend, in fp32:

- the knob is validated before a pool exists; a head_dim that is not a power of two gets the block Hadamard matrix;
- over K/V the pool holds exactly (every row in the fp32 frames: a context within the fp16 window), the rotated
  backend gives plain attention over the true K/V: extend, a continuation reading the cached prefix, decode on each
  kvq_torch decode path; and the frames hold v @ H (and k @ H where q and K are rotated too, "hadamard");
- over packed pages, the rotated backend's output is the oracle (sgl_kvq/attention_ref.py) run on the (rotated) q
  over what the pool stores, rotated back, on each decode path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sgl_kvq.attention_ref import _attend, gather_context, ref_decode  # noqa: E402
from sgl_kvq.attention_rotation import HeadRotation, basis  # noqa: E402
from sgl_kvq.backends.torch_backend import KVQTorchBackend  # noqa: E402
from sgl_kvq.config import KVQConfig, KVQConfigError, parse_kv_cache_dtype  # noqa: E402
from sgl_kvq.kernels import cpu_decode_attention  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from sgl_kvq.quant.rotation import is_orthogonal  # noqa: E402

G, H, HQ, D, L = 8, 2, 4, 16, 2
SCALE = D ** -0.5
LAYER = [SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=H, tp_v_head_num=H, qk_head_dim=D,
                         v_head_dim=D, scaling=SCALE, is_cross_attention=False, sliding_window_size=None,
                         logit_cap=0) for i in range(L)]
DECODE_PATHS = ("padded", "pages", "cpu_kernel")


# ---- the knob ----

def test_rotate_knob_is_read_and_validated(monkeypatch):
    monkeypatch.setenv("KVQ_ROTATE", "hadamard")
    assert parse_kv_cache_dtype("kivi2").rotate == "hadamard"
    monkeypatch.setenv("KVQ_ROTATE", "values")
    assert parse_kv_cache_dtype("kivi2").rotate == "values"
    monkeypatch.setenv("KVQ_ROTATE", "walsh")
    with pytest.raises(KVQConfigError, match="KVQ_ROTATE='walsh'"):
        parse_kv_cache_dtype("kivi2")
    monkeypatch.setenv("KVQ_ROTATE", "none")
    assert parse_kv_cache_dtype("kivi3").rotate == "none"
    monkeypatch.delenv("KVQ_ROTATE")  # each dtype's default (sgl_kvq/formats/rotation.py)
    assert parse_kv_cache_dtype("kivi2").rotate == "values" and parse_kv_cache_dtype("kivi3").rotate == "none"


def test_a_head_dim_that_is_not_a_power_of_two_rotates_in_hadamard_blocks():
    """head_dim 48 (packable at value group 16) is rotated by three 16 x 16 Hadamard blocks: orthogonal, and a
    row's channels mix only within their block."""
    KVQConfig("kivi", 2, value_group=16, rotate="values").check_head_dim(48)
    r = basis("values", 48)
    assert is_orthogonal(r)
    torch.testing.assert_close(r[:16, :16], basis("values", 16))
    assert not r[:16, 16:].any() and not r[16:32, 32:].any()
    torch.testing.assert_close(basis("hadamard", 128), basis("values", 128))


def test_head_rotation_is_orthogonal_and_round_trips():
    r = basis("hadamard", D)
    assert basis("none", D) is None and is_orthogonal(r)
    rot = HeadRotation(r)
    x = torch.randn(5, HQ * D, generator=torch.Generator().manual_seed(0))
    q, k, v = HeadRotation(r, keys=False).inputs(x, x, x)
    assert q is x and k is x and torch.equal(v, rot.into(x))
    y = rot.into(x)
    torch.testing.assert_close(y.view(5, HQ, D), x.view(5, HQ, D) @ r)
    torch.testing.assert_close(rot.back(y), x, atol=1e-6, rtol=1e-6)
    assert rot.into(None) is None and rot.into(x.to(torch.bfloat16)).dtype == torch.bfloat16


# ---- the backend ----

def make(rotate: str, residual: int, path: str, g: int = G):
    cfg = KVQConfig("kivi", 2, group_size=g, value_group=8, residual=residual, rotate=rotate,
                    cpu_kernel=int(path == "cpu_kernel"))
    pool = KVQTokenToKVPool(32 * g, PoolShape(L, H, D, 32, cfg), "cpu", torch.float32, num_req_slots=4)
    r2t = torch.zeros(4, 256, dtype=torch.int32)
    r2t[1] = torch.arange(256, dtype=torch.int32) + g  # request slot 1's positions, from pool page 1 on
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t))
    backend = KVQTorchBackend(runner)
    if path != "cpu_kernel":  # steer kvq_torch's choice between its two torch decode paths
        backend.decode_path = _forced(backend, path)
    return backend, pool


def _forced(backend, path):
    """kvq_torch's decode_path taking `path` on every batch (sgl_kvq/decode_paths.py's rule would pick by size)."""
    from sgl_kvq import decode_paths

    return lambda plan, kv: (path, decode_paths.prepare(path, plan, backend.store.G, backend.store.shape.heads))


class Request:
    """True K/V per layer and queries of a request at pool slots G + position."""

    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(n, H, D, generator=gen) for _ in range(L)]
        self.v = [torch.randn(n, H, D, generator=gen) for _ in range(L)]
        self.q = torch.randn(n, HQ, D, generator=gen)


def run(backend, req: Request, prefix: int, new: int) -> list[torch.Tensor]:
    """Positions prefix .. prefix+new through SGLang's forward entry, one forward: an extend, or a decode of one."""
    mode = ForwardMode.DECODE if new == 1 and prefix else ForwardMode.EXTEND
    fb = SimpleNamespace(forward_mode=mode, req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([prefix + new]),
                         out_cache_loc=torch.arange(prefix, prefix + new) + backend.store.G,
                         extend_prefix_lens_cpu=[prefix],
                         extend_seq_lens_cpu=[new])
    backend.init_forward_metadata(fb)
    outs = []
    for li in range(L):
        q, k, v = (x[prefix:prefix + new].reshape(new, -1) for x in (req.q, req.k[li], req.v[li]))
        entry = backend.forward_decode if mode.is_decode() else backend.forward_extend
        outs.append(entry(q, k, v, LAYER[li], fb).view(new, HQ, D))
    return outs


def exact(req: Request, li: int, lo: int, hi: int) -> torch.Tensor:
    """Positions lo..hi-1 attending causally to every earlier position's true K/V."""
    mask = torch.arange(hi).unsqueeze(0) <= torch.arange(lo, hi).unsqueeze(1)
    return _attend(req.q[lo:hi], req.k[li][:hi], req.v[li][:hi], SCALE, mask)


@pytest.mark.parametrize("rotate", ("values", "hadamard"))
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_rotated_attention_is_plain_attention_over_exactly_held_kv(path, rotate):
    """R = 4 pages: 36 positions never leave the fp32 frames, so nothing is quantized and every output must be
    plain attention over the true K/V, rotated or not (the rotation is orthogonal, applied to v (and q, k), undone
    on the output)."""
    if path == "cpu_kernel" and not cpu_decode_attention.available():
        pytest.skip(cpu_decode_attention.unavailable_reason())
    req = Request(36, seed=1)
    backend, pool = make(rotate, residual=4 * G, path=path)
    steps = [(0, 20), (20, 10)] + [(p, 1) for p in range(30, 36)]  # prefill, a continuation, six decode steps
    for prefix, new in steps:
        outs = run(backend, req, prefix, new)
        for li in range(L):
            torch.testing.assert_close(outs[li], exact(req, li, prefix, prefix + new), atol=2e-5, rtol=2e-5)
    r = basis(rotate, D)
    rk = r if rotate == "hadamard" else torch.eye(D)
    for li in range(L):
        k_held, v_held = gather_context(pool.store.layer_view(li), backend.forward_plan.steps[0].plan, 0)
        torch.testing.assert_close(k_held, req.k[li] @ rk, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v_held, req.v[li] @ r, atol=1e-6, rtol=1e-6)
    if path == "cpu_kernel":
        assert pool.decode_batches["cpu_kernel"] == 6


@pytest.mark.parametrize("rotate", ("values", "hadamard"))
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_rotated_decode_over_packed_pages_is_the_oracle_in_the_rotated_basis(path, rotate):
    """R = G: a 72-token context is mostly 2-bit pages. The rotated backend's decode output equals the oracle
    (attention_ref.ref_decode) of the (rotated) q over the rotated rows the pool stores, rotated back; the unrotated
    backend's pages are another basis's, so its output differs."""
    if path == "cpu_kernel" and not cpu_decode_attention.available():
        pytest.skip(cpu_decode_attention.unavailable_reason())
    req = Request(72, seed=2)
    rot = HeadRotation(basis(rotate, D), keys=rotate == "hadamard")
    q_in = rot.into if rot.keys else (lambda x: x)
    outs = {}
    for mode in (rotate, "none"):
        backend, pool = make(mode, residual=G, path=path)
        run(backend, req, 0, 64)
        for p in range(64, 72):
            outs[mode] = run(backend, req, p, 1)
        if mode == rotate:
            plan = backend.forward_plan.steps[0].plan
            for li in range(L):
                want = rot.back(ref_decode(q_in(req.q[71:72]), pool.store.layer_view(li), plan, SCALE))
                torch.testing.assert_close(outs[mode][li], want, atol=2e-5, rtol=2e-5)
    for li in range(L):
        assert not torch.allclose(outs[rotate][li], outs["none"][li], atol=1e-3)


# ---- kvq_triton: the values rotation fused into the decode kernels ----

TG = 16  # the Triton kernels' smallest page (a tl.dot tile)


def make_triton(rotate: str, residual: int, monkeypatch):
    """kvq_triton over `make`'s pool geometry at G = TG (the Triton interpreter on a CPU)."""
    from sgl_kvq.backends import triton_backend

    monkeypatch.setattr(triton_backend, "query_heads_on_this_rank", lambda runner: HQ)
    cfg = KVQConfig("kivi", 2, group_size=TG, value_group=8, residual=residual, rotate=rotate)
    pool = KVQTokenToKVPool(32 * TG, PoolShape(L, H, D, 32, cfg), "cpu", torch.float32, num_req_slots=4)
    r2t = torch.zeros(4, 256, dtype=torch.int32)
    r2t[1] = torch.arange(256, dtype=torch.int32) + TG
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t))
    return triton_backend.KVQTritonBackend(runner), pool


def test_triton_decode_applies_the_values_rotation_in_its_kernels(monkeypatch):
    """kvq_triton's decode rotates V in the overlay write and the output in the split merge (no products at the
    entry): over 2-bit pages it gives kvq_torch's output, whose entry rotates around the same attention, and both
    pools hold the same rotated frames and codes. The entry's products are not run for decode (they are counted)."""
    if cpu_decode_attention.available():
        monkeypatch.setattr(cpu_decode_attention, "available", lambda: False)  # kvq_torch on its torch paths
    req = Request(80, seed=3)
    (tri, tri_pool), (ref, ref_pool) = make_triton("values", TG, monkeypatch), make("values", TG, "padded", g=TG)
    assert tri.kernel_rotation is not None and ref.kernel_rotation is None
    entry_products = []
    into = type(tri.rotation).into
    monkeypatch.setattr(type(tri.rotation), "into", lambda self, x: entry_products.append(self) or into(self, x))
    for backend in (tri, ref):
        run(backend, req, 0, 56)
    for p in range(56, 80):  # 24 decode steps: pages 4 and 5 complete and are packed from rotated frames
        entry_products.clear()
        got, want = run(tri, req, p, 1), run(ref, req, p, 1)
        assert all(r is ref.rotation for r in entry_products), "kvq_triton's decode rotated at the entry"
        for li in range(L):
            torch.testing.assert_close(got[li], want[li], atol=2e-5, rtol=2e-5)
    for li in range(L):
        a, b = tri_pool.store.layer_view(li), ref_pool.store.layer_view(li)
        used = slice(TG, 6 * TG)  # pool pages 1..5: the request's complete pages
        assert torch.equal(a.k_codes[used], b.k_codes[used]) and torch.equal(a.v_codes[used], b.v_codes[used])
        assert torch.equal(a.v_scale[used], b.v_scale[used])
