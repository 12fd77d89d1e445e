"""HiCache's host pool for packed pages (sgl_kvq/host_pool.py), driven directly through SGLang's host-pool interface
(HostKVCache: alloc, backup_from_device_all_layer, load_to_device_per_layer, flat data pages), since SGLang's
HiCache does not start on the CPU engine (docs/deployment.md, "HiCache"). Pages are written by the real store path,
backed up, clobbered on the device, and loaded back into other pages: bytes and attention must come back exact.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from sgl_kvq.config import parse_kv_cache_dtype  # noqa: E402
from sgl_kvq.host_pool import KVQTokenToKVPoolHost  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from pool_writes import D, H, L, read, write  # noqa: E402


def slots_of(pages: list[int], G: int) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * G + torch.arange(G)).reshape(-1)


def page_bytes(pool, pages: list[int]) -> dict[str, list[torch.Tensor]]:
    """Each base buffer's rows of `pages`, per layer ([pages, rows, ...]: a recipe's layers differ in shape)."""
    G, P = pool.shape.G, pool.shape.P
    out = {}
    for name in pool.shape.base_names():
        out[name] = []
        for layer in range(L):
            t = getattr(pool.store, name)[layer]
            rows = 1 if t.shape[0] == P else G
            out[name].append(t.view(P, rows, *t.shape[1:])[pages].clone())
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def recipe_env(tmp_path, monkeypatch):
    """KVQ_RECIPE for a kivimix pool of pool_writes' L layers, each at other widths."""
    from sgl_kvq.recipe import ModelBinding, Recipe

    widths = [(4, 1), (1, 3), (3, 2)][:L]
    (tmp_path / "r.json").write_text(Recipe(ModelBinding(L, H, D, "0" * 16), tuple(k for k, _ in widths),
                                            tuple(v for _, v in widths)).to_json())
    monkeypatch.setenv("KVQ_RECIPE", str(tmp_path / "r.json"))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("name", ["kivi2", "kivi3", "gear2", "logquant2", "zipcache2", "kivimix"])
def test_pages_come_back_exact(name, layout, request):
    if name == "kivimix":
        request.getfixturevalue("recipe_env")
    cfg = parse_kv_cache_dtype(name)
    G = cfg.group_size
    pool = KVQTokenToKVPool(14 * G, PoolShape(L, H, D, 14, cfg), "cpu", torch.float32, num_req_slots=4)
    host = KVQTokenToKVPoolHost(pool, 2.0, 0, G, layout)
    a, x = [2, 3, 5, 6, 7], [8, 9, 10, 11]
    # request A (slot 1) keeps its last pages in fp16 frames; prefix X (slot 2) is 4 complete pages
    write(pool, 1, torch.tensor(a), 0, 4 * G + 3, seed=1)
    write(pool, 2, torch.tensor(x), 0, 4 * G, seed=2)
    q = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(3))
    # what a request hitting X's prefix in the radix tree reads: its pages from the base (slot 0 has no frames)
    ctx_x, out_x, plan_x = read(pool, 0, torch.tensor(x), 4 * G, q)
    assert int(plan_x.ov_indptr[1]) == 0
    want = page_bytes(pool, x)

    h_idx = host.alloc(4 * G)
    host.backup_from_device_all_layer(pool, h_idx, slots_of(x, G), "direct")
    write(pool, 3, torch.tensor(x), 0, 4 * G, seed=9)  # X's device pages reused by another request
    assert any(not _equal(want[n], t) for n, t in page_bytes(pool, x).items())
    # A finished and its pages were freed: X's prefix is loaded back into them, layer by layer. A's frames in
    # slot 1 still name pages 5 and 6 at logical pages 2 and 3: they must not stand in for the loaded pages.
    for layer in range(L):
        host.load_to_device_per_layer(pool, h_idx, slots_of(a[:4], G), layer, "direct")
    got = page_bytes(pool, a[:4])
    for n in want:
        assert _equal(got[n], want[n]), f"{name} {layout}: {n} differs after the round trip"
    ctx, out, plan = read(pool, 1, torch.tensor(a[:4]), 4 * G, q)
    assert int(plan.ov_indptr[1]) == 0, "loaded pages are read from the base"
    for (k0, v0), (k1, v1) in zip(ctx_x, ctx):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert all(torch.equal(o0, o1) for o0, o1 in zip(out_x, out))

    # storage backends move pages as flat bytes: a page copied through them reads the same
    h2 = host.alloc(G)
    host.set_from_flat_data_page(int(h2[0]), host.get_data_page(int(h_idx[G])))
    assert host.get_data_page(int(h2[0])).numel() == host.page_bytes == host.get_dummy_flat_data_page().numel()
    for layer in range(L):
        host.load_to_device_per_layer(pool, h2, slots_of([12], G), layer, "direct")
    assert all(_equal(page_bytes(pool, [12])[n], [w[1:2] for w in want[n]]) for n in want)


@pytest.mark.parametrize("name,min_ratio", [("kivi2", 6.0), ("kivi4", 3.5), ("kivi3", 4.5), ("gear2", 4.0),
                                            ("logquant2", 5.5), ("zipcache2", 3.4), ("kivimix", 4.5)])
def test_host_tier_holds_more_tokens_than_bf16(name, min_ratio, request):
    """Tokens per host byte against SGLang's bf16 MHA host pool (its own get_size_per_token), from the bytes this
    host pool really allocates."""
    if name == "kivimix":
        request.getfixturevalue("recipe_env")
    cfg = parse_kv_cache_dtype(name)
    G = cfg.group_size
    pool = KVQTokenToKVPool(8 * G, PoolShape(L, H, D, 8, cfg), "cpu", torch.float32, num_req_slots=2)
    host = KVQTokenToKVPoolHost(pool, 4.0, 0, G, "layer_first")
    assert host.nbytes() == host.size * host.get_size_per_token()
    assert host.get_size_per_token() == pool.shape.base_bytes_per_token()
    bf16 = MHATokenToKVPoolHost.get_size_per_token(SimpleNamespace(head_dim=D, v_head_dim=D, head_num=H,
                                                                   layer_num=L, dtype=torch.bfloat16))
    ratio = bf16 / (host.nbytes() / host.size)
    print(f"{name}: host {host.nbytes() / host.size:.1f} B/token, bf16 {bf16} B/token: {ratio:.2f}x the tokens")
    assert ratio >= min_ratio


def test_storage_keys_pages_on_the_fingerprint():
    """SGLang's storage backends key pages on the model name tagged with the host pool's storage_format_tag
    (cache_controller.storage_model_name): a page stored under one rotation or GEAR rank is never read under another,
    and one stored under the same config is."""
    from dataclasses import replace

    from sglang.srt.managers.cache_controller import storage_model_name

    def tag(cfg):
        pool = KVQTokenToKVPool(8 * cfg.group_size, PoolShape(L, H, D, 8, cfg), "cpu", torch.float32,
                                num_req_slots=2)
        return storage_model_name("m", KVQTokenToKVPoolHost(pool, 2.0, 0, cfg.group_size, "page_first"))

    gear = parse_kv_cache_dtype("gear2")
    names = {tag(gear), tag(replace(gear, rotate="none")), tag(replace(gear, params=replace(gear.params, rank=3))),
             tag(parse_kv_cache_dtype("kivi2"))}
    assert len(names) == 4 and all(n.startswith("m-sgl_kvq-") for n in names)
    assert tag(gear) == tag(parse_kv_cache_dtype("gear2"))
