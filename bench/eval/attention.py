"""Attention fidelity of every KV format on real Q/K/V captured from a model.

Capture: forward hooks on each attention layer recompute q/k/v with the layer's own q_proj/k_proj/v_proj, its
q_norm/k_norm where it has them (Gemma 3), and its module's apply_rotary_pos_emb (post-RoPE, what a KV cache holds),
and record the input of o_proj (the model's own attention output) and the layer's sliding window (HF's
`sliding_window`: query i sees keys i - window + 1 .. i; None on full-attention layers). `capture_check` is the
relative error of causal_attention(q, k, v, window) against that output: it proves the captured tensors are the ones
the model attends with. Every method's attention on a layer uses that layer's window.

Metrics per method, averaged over layers (per-layer values are in the JSON):
    bits          bits per element actually stored (bench.quant.accounting), keys / values / both
    bytes/token   (table only, when the run records the model's layer count) K+V bytes per token over all layers
                  at those bits: bits * 2 * kv_heads * head_dim * layers / 8
    k_err, v_err  ||X_hat - X|| / ||X|| over the whole [T, H, D] tensor
    attn_err      ||O_hat - O_fp16|| / ||O_fp16||, causal attention of ALL real queries over the compressed cache
                  as it stands at length T (the state a shared prefix is reused in: the window sits at the end,
                  so early queries see only quantized tokens)
    attn_err_tail the same over the last `tail` queries only (decode-like: they see the fp16 window)
    kept_mass     share of the fp16 attention mass of the last `tail` queries that lands on the tokens the method
                  holds above base precision (fp16 window/selection, or ZipCache's 4-bit salient tokens)
    kept_share    share of (token, head) pairs held above base precision

Methods: ours (KIVI at 1-4 bits, kivi3 through kivi_bits, GEAR, ZipCache, LogQuant; the KIVI-style ones keep the
fp16 window; SpeCache's read of its low-bit copy with each query's top-k rows in 16 bits, bench/eval/specache.py),
KIVI 2/3 in a Hadamard basis (sgl_kvq.quant.rotation.rotated: q/k/v rotated alike, output rotated back), each
shipped recipe (kivimix-NAME: every layer KIVI at the recipe's key and value widths for that layer), and the
formats the engines ship (sgl_kvq.formats.peers.reference: SGLang fp8_e4m3 / fp4_mx_block16 / nvfp4, vLLM
int4_per_token_head and TurboQuant), which quantize every token and keep no window.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from sgl_kvq.formats.logquant import LogQuantParams
from sgl_kvq.formats.specache import SPECACHE_TOP_K
from bench.quant.accounting import bits_per_element
from bench.quant.gear import gear, gear_l
from bench.quant.kivi import fp16_baseline, kivi
from bench.quant.logquant import logquant
from bench.quant.kivi_bits import kivi_bits
from sgl_kvq.formats.peers.reference import fp4_mx_block16, fp8_e4m3, int4_per_token_head, nvfp4, turboquant, \
    turboquant_preset
from bench.quant.per_token import per_token
from sgl_kvq.quant.rotation import block_hadamard, hadamard, rotated
from sgl_kvq.recipe import load_recipe, shipped
from bench.quant.zipcache import zipcache
from bench.eval.masks import visible
from bench.eval.specache import specache

REFERENCE = "fp16"


@dataclass
class LayerQKV:
    q: torch.Tensor  # [T, Hq, D] fp32, post-RoPE
    k: torch.Tensor  # [T, H, D]
    v: torch.Tensor  # [T, H, D]
    out: torch.Tensor | None  # [T, Hq, D]: the model's own attention output (input of o_proj)
    sm_scale: float
    window: int | None = None  # HF's sliding_window: query i sees keys i - window + 1 .. i; None: all of 0..i


@dataclass(frozen=True)
class ByLayer:
    """A method whose pages depend on the layer (a kivimix recipe's widths): layer index -> fn(k, v, q, s)."""
    at: Callable[[int], Callable]


def _values_rotated(fn):
    if isinstance(fn, ByLayer):
        return ByLayer(lambda i: rotated(fn.at(i), block_hadamard, keys=False))
    return rotated(fn, block_hadamard, keys=False)


def recipe_method(name: str, **kv) -> ByLayer:
    """A shipped recipe's pages: each layer KIVI at its key and value widths (kivi_bits), the engine's fp16 window."""
    recipe = load_recipe(name)

    def at(layer: int):
        k_bits, v_bits = recipe.widths(layer)
        return lambda k, v, q, s: kivi_bits(k, v, bits=k_bits, value_bits=v_bits, **kv)
    return ByLayer(at)


def methods(group_size: int = 64, value_group: int = 64, residual: int = 64, window: int | None = None) -> dict:
    """name -> fn(k, v, q, sm_scale) -> CompressedKV. Every method shares G, VG and the fp16 window R."""
    page = dict(group_size=group_size, value_group=value_group)
    kv = dict(page, residual=residual)
    w = LogQuantParams.window if window is None else window  # the served logquant2's W
    ours = {
        "fp16": lambda k, v, q, s: fp16_baseline(k, v),
        "per-token-2": lambda k, v, q, s: per_token(k, v, bits=2, **kv),
        "kivi4": lambda k, v, q, s: kivi(k, v, bits=4, **kv),
        "kivi2": lambda k, v, q, s: kivi(k, v, bits=2, **kv),
        "kivi1": lambda k, v, q, s: kivi(k, v, bits=1, **kv),
        "kivi1-plain": lambda k, v, q, s: kivi(k, v, bits=1, specache_one_bit=False, **kv),
        "gear-l-2": lambda k, v, q, s: gear_l(k, v, bits=2, **kv),  # the served gearl2's pages
        "gear-2": lambda k, v, q, s: gear(k, v, bits=2, **kv),  # gear2's
        "zipcache": lambda k, v, q, s: zipcache(k, v, q, s, **kv),  # the served zipcache2's pages (40% salient)
        "zipcache-0.6": lambda k, v, q, s: zipcache(k, v, q, s, salient_ratio=0.6, **kv),  # the authors' demo share
        "logquant-2": lambda k, v, q, s: logquant(k, v, bits=2, window=w, **kv),  # the served logquant2's pages
        # the same at W = 21 (3W ~ R = 64: the paper's fp16 budget), 8 rows per page at G = R = 64
        "logquant-2-w21": lambda k, v, q, s: logquant(k, v, bits=2, window=21, **kv),
        # KIVI at 3 bits (bit-stream packed), and KIVI 2/3 in an orthogonal Hadamard basis along head_dim
        "kivi3": lambda k, v, q, s: kivi_bits(k, v, bits=3, **kv),
        "kivi2-had": rotated(lambda k, v, q, s: kivi(k, v, bits=2, **kv), hadamard),
        "kivi3-had": rotated(lambda k, v, q, s: kivi_bits(k, v, bits=3, **kv), hadamard),
        "kivi4-had": rotated(lambda k, v, q, s: kivi(k, v, bits=4, **kv), hadamard),
        # SpeCache's read: the low-bit copy with each query's top-k base rows per KV head in 16 bits, at the served
        # top-k and ranking (bench/eval/specache.py: the speculative lane's guess modelled as right)
        **{f"specache{b}": (lambda k, v, q, s, b=b: specache(k, v, bits=b, top_k=SPECACHE_TOP_K[b], **kv))
           for b in SPECACHE_TOP_K},
        # each shipped recipe's per-layer widths (kivimix:KVQ_RECIPE=NAME), named kivimix-NAME
        **{f"kivimix-{name}": recipe_method(name, **kv) for name in shipped()},
    }
    # its read with the values of both copies in the Hadamard basis
    ours.update({f"specache{b}-hadv": (lambda k, v, q, s, b=b: specache(
        k, v, bits=b, top_k=SPECACHE_TOP_K[b], values_basis=block_hadamard(k.shape[-1]), **kv))
        for b in SPECACHE_TOP_K})
    # the same with the device copy's keys and values at different widths (K1V2: 1-bit keys, 2-bit values), at the
    # top-k of its key width, values in either basis: whether a split copy would pay (docs/recipes.md, "SpeCache's
    # device copy")
    for kb, vb in ((1, 2), (2, 1)):
        for tag, basis in (("", None), ("-hadv", block_hadamard)):
            ours[f"specache-K{kb}V{vb}{tag}"] = (lambda k, v, q, s, kb=kb, vb=vb, basis=basis: specache(
                k, v, bits=kb, value_bits=vb, top_k=SPECACHE_TOP_K[kb],
                values_basis=None if basis is None else basis(k.shape[-1]), **kv))
    # each of ours with its values alone in the Hadamard basis (KVQ_ROTATE=values: keys per channel keep their
    # outlier channels apart), named <method>-hadv; SpeCache's read is not one reconstruction, and rotates its own
    values_rotated = {f"{name}-hadv": _values_rotated(fn) for name, fn in ours.items()
                      if name not in ("fp16", "per-token-2") and not name.endswith(("-had", "-hadv"))
                      and not name.startswith("specache")}
    return {
        **ours,
        **values_rotated,
        # what the engines ship (sgl_kvq.formats.peers.reference): every token quantized, no fp16 window
        "fp8_e4m3": lambda k, v, q, s: fp8_e4m3(k, v),  # SGLang fp8_e4m3, scale 1
        "fp4_mx_block16": lambda k, v, q, s: fp4_mx_block16(k, v),  # SGLang fp4_mx_block16
        "nvfp4": lambda k, v, q, s: nvfp4(k, v),  # SGLang nvfp4, global scale amax / (6 * 448) per layer
        "nvfp4-gs1": lambda k, v, q, s: nvfp4(k, v, global_scale=1.0),  # ... its fallback without calibrated scales
        "int4-pth-asym": lambda k, v, q, s: int4_per_token_head(k, v),  # vLLM int4_per_token_head (RHT + asym)
        "int4-pth-sym": lambda k, v, q, s: int4_per_token_head(k, v, symmetric=True),
        "tq3": lambda k, v, q, s: turboquant(k, v, key_bits=3, value_bits=3, value_mode="mse"),  # TurboQuant_mse
        "tq4": lambda k, v, q, s: turboquant(k, v, key_bits=4, value_bits=4, value_mode="mse"),
        "tq-3bit-nc": lambda k, v, q, s: turboquant_preset(k, v, "turboquant_3bit_nc"),  # vLLM's presets
        "tq-4bit-nc": lambda k, v, q, s: turboquant_preset(k, v, "turboquant_4bit_nc"),
        "tq-k8v4": lambda k, v, q, s: turboquant_preset(k, v, "turboquant_k8v4"),
    }


# The method that builds each served dtype's pages (`sgl-kvq bench decision` reads its rows): ours with the engine's
# fp16 window, the peers' without one (they quantize every token; peer_nvfp4 at global scale 1, as served), SpeCache's
# read at its served top-k; with its values in the Hadamard basis (<method>-hadv) where the dtype's default rotates them
# (KVQ_ROTATE=values, sgl_kvq/formats/rotation.py).
_UNROTATED_METHODS = {"specache1": "specache1", "specache2": "specache2", "kivi1": "kivi1", "kivi2": "kivi2",
                      "kivi3": "kivi3", "kivi4": "kivi4", "gear2": "gear-2", "gearl2": "gear-l-2",
                      "logquant2": "logquant-2", "zipcache2": "zipcache",
                      "peer_fp8_e4m3": "fp8_e4m3", "peer_fp4_mx_block16": "fp4_mx_block16", "peer_nvfp4": "nvfp4-gs1",
                      "peer_int4": "int4-pth-asym", "peer_tq3": "tq-3bit-nc", "peer_tq4": "tq-4bit-nc"}


def _served_method(dtype: str, method: str, recipe: str | None = None) -> str:
    from sgl_kvq.config import default_config

    return f"{method}-hadv" if default_config(dtype, recipe).rotate == "values" else method


DTYPE_METHODS = {d: _served_method(d, m) for d, m in _UNROTATED_METHODS.items()}
# kivimix rotates its values by default, as kivi2-4 do (KiviMix.default_knobs)
DTYPE_METHODS.update({f"kivimix:KVQ_RECIPE={name}": _served_method("kivimix", f"kivimix-{name}", recipe=name)
                      for name in shipped()})


def _expand(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[T, H, ...] -> [T, Hq, ...]: each KV head serves hq // H query heads (GQA)."""
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                     kept: list[torch.Tensor] | None = None, tail: int = 0, chunk: int = 512,
                     window: int | None = None):
    """q [T, Hq, D], k/v [T, H, D] -> O [T, Hq, D] fp32 (query i sees keys 0..i; with `window`, i - window + 1..i).

    With `kept` ([T, H] bool masks), also returns each mask's share of the attention mass of the last `tail`
    queries (mean over those queries and the query heads)."""
    T, hq, _ = q.shape
    k, v = _expand(k.float(), hq), _expand(v.float(), hq)
    masks = torch.stack([_expand(m, hq) for m in kept]).float() if kept else None  # [M, T, Hq]
    out, mass = torch.empty(T, hq, v.shape[-1]), torch.zeros(len(kept or []))
    for lo in range(0, T, chunk):
        hi = min(T, lo + chunk)
        s = torch.einsum("rhd,thd->hrt", q[lo:hi].float(), k) * sm_scale
        causal = visible(torch.arange(lo, hi), T, window)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)  # [Hq, rows, T]
        out[lo:hi] = torch.einsum("hrt,thd->rhd", p, v)
        first = max(lo, T - tail) - lo
        if masks is not None and first < hi - lo:
            mass += torch.einsum("hrt,mth->m", p[:, first:], masks)
    return (out, mass / (max(1, min(tail, T)) * hq)) if kept is not None else out


def rel_err(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float((x_hat.float() - x.float()).norm() / x.float().norm().clamp(min=1e-30))


def load_model(name: str):
    """'smollm2' | 'tiny' | a model folder -> (float32 model in eval mode, tokenizer, folder)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.models import BUILDERS

    path = BUILDERS[name]() if name in BUILDERS else name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path), str(path)


def capture(model, input_ids: torch.Tensor, layers: list[int]) -> dict[int, LayerQKV]:
    """One forward pass over input_ids [1, T]; returns the post-RoPE q/k/v and attention output of `layers`."""
    store, hooks = {}, []
    for i in layers:
        attn = model.model.layers[i].self_attn
        rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb

        def before(module, args, kwargs, i=i, rope=rope):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            shape = (*h.shape[:-1], -1, module.head_dim)
            q = module.q_proj(h).view(shape).transpose(1, 2)
            k = module.k_proj(h).view(shape).transpose(1, 2)
            v = module.v_proj(h).view(shape).transpose(1, 2)
            if getattr(module, "q_norm", None) is not None:  # Gemma 3, Qwen3: RMSNorm per head before RoPE
                q, k = module.q_norm(q), module.k_norm(k)
            q, k = rope(q, k, cos, sin)
            store[i] = LayerQKV(q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(),
                                v[0].transpose(0, 1).contiguous(), out=None, sm_scale=float(module.scaling),
                                window=getattr(module, "sliding_window", None))

        def attn_out(module, args, i=i):
            store[i].out = args[0][0].reshape(store[i].q.shape).clone()

        hooks.append(attn.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(attn.o_proj.register_forward_pre_hook(attn_out))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return store


def evaluate_layer(layer: LayerQKV, table: dict, tail: int, index: int) -> dict:
    """Every method on layer `index` -> {name: metrics}."""
    q, k, v, s, w = layer.q, layer.k, layer.v, layer.sm_scale, layer.window
    comp = {name: (fn.at(index) if isinstance(fn, ByLayer) else fn)(k, v, q, s) for name, fn in table.items()}
    ref = comp[REFERENCE]
    o_ref, mass = causal_attention(q, ref.k_hat, ref.v_hat, s, kept=[c.kept for c in comp.values()], tail=tail,
                                   window=w)
    res = {}
    for (name, c), m in zip(comp.items(), mass):
        if name == REFERENCE:
            o = o_ref
        elif hasattr(c, "attend"):  # a read that depends on the query (SpeCache's top-k rows)
            o = c.attend(q, s, window=w)
        else:
            o = causal_attention(q, c.k_hat, c.v_hat, s, window=w)
        b = bits_per_element(c)
        res[name] = {"bits_k": b.keys, "bits_v": b.values, "bits": b.total,
                     "k_err": rel_err(c.k_hat, k), "v_err": rel_err(c.v_hat, v),
                     "attn_err": rel_err(o, o_ref), "attn_err_tail": rel_err(o[-tail:], o_ref[-tail:]),
                     "kept_mass": float(m), "kept_share": float(c.kept.float().mean())}
    return res


def evaluate(captured: dict[int, LayerQKV], table: dict, tail: int = 64, log=None) -> dict:
    """-> {"capture_check": ..., "methods": {name: {metric: mean over layers, "per_layer": {metric: [..]}}}}."""
    per_layer, check = [], []
    for i, layer in captured.items():
        t0 = time.time()
        if layer.out is not None:
            check.append(rel_err(causal_attention(layer.q, layer.k, layer.v, layer.sm_scale, window=layer.window),
                                 layer.out))
        per_layer.append(evaluate_layer(layer, table, tail, i))
        if log:
            log(f"layer {i}: {time.time() - t0:.1f}s")
    out = {}
    for name in table:
        rows = [r[name] for r in per_layer]
        out[name] = {m: sum(r[m] for r in rows) / len(rows) for m in rows[0]}
        out[name]["per_layer"] = {m: [r[m] for r in rows] for m in rows[0]}
    return {"capture_check": {"max_rel_err": max(check, default=0.0), "per_layer": check}, "methods": out}


COLUMNS = [("bits_k", "bits K", "{:.2f}"), ("bits_v", "bits V", "{:.2f}"), ("bits", "bits K+V", "{:.2f}"),
           ("k_err", "K rel err", "{:.4f}"), ("v_err", "V rel err", "{:.4f}"),
           ("attn_err", "attn err (all q)", "{:.4f}"), ("attn_err_tail", "attn err (tail q)", "{:.4f}"),
           ("kept_mass", "mass on kept (tail q)", "{:.3f}"), ("kept_share", "kept share", "{:.3f}")]


def bytes_per_token(bits: float, kv_heads: int, head_dim: int, layers: int) -> float:
    """K+V bytes one token costs over all layers at `bits` per element (the mean over K and V)."""
    return bits * 2 * kv_heads * head_dim * layers / 8


def markdown(result: dict) -> str:
    """The table; with the model's layer count and KV shape in `result`, also bytes per token over all its layers."""
    shape, layers = result.get("shape"), result.get("model_layers")
    per_token = shape is not None and layers is not None
    names = [c[1] for c in COLUMNS[:3]] + ["bytes/token"] * per_token + [c[1] for c in COLUMNS[3:]]
    lines = ["| method | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for name, m in result["methods"].items():
        cells = [fmt.format(m[key]) for key, _, fmt in COLUMNS]
        if per_token:
            cells.insert(3, f"{bytes_per_token(m['bits'], shape['kv_heads'], shape['head_dim'], layers):.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
