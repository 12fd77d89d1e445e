"""Each layer's key and value sensitivity to their code width, measured in the model, and the allocation of widths
that meets a budget at the least measured loss (`sgl-kvq calibrate`).

The read it simulates is kvq's decode read (teacher-forced over a calibration text): the query at position t reads
every complete page before its fp16 window (t's open page and the R / G pages before it) from KIVI's packed pages,
everything after from fp16. A page's keys are quantized per channel over its G post-RoPE tokens, its values per
token in groups of VG channels (Hadamard-rotated first where the dtype of that width stores them rotated: formats/
rotation.py), with the served quantizer (sgl_kvq.quant.uniform through bench.quant.kivi_bits).

Sensitivity of (layer, K or V, width b): the mean KL(fp16 || that one tensor quantized at b, the rest fp16) of the
next-token distributions over the positions that read any quantized page. The layers before it are unchanged, so
each measurement runs the model from that layer's cached input.

Allocation: every (layer, K or V) starts at the widest width; greedily, the step down one width that adds the least
KL per byte saved is taken, until the mean width meets --bits (the per-layer KLs are assumed to add; the result's
KL, measured with every layer at its width, says how far that holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bench.quant.kivi_bits import kivi_bits
from sgl_kvq.attention_rotation import block_hadamard
from sgl_kvq.formats.rotation import VALUES_ROTATED
from sgl_kvq.layout import PageGeometry, counts_as_value, kivi_shapes

KINDS = ("k", "v")
NAME = "kvq_calibration"


@dataclass
class Reader:
    """What the simulated decode read quantizes: {(layer, kind): bits}; the page geometry; every `stride`-th
    position that reads a packed page is scored (a large vocabulary's softmax per position is most of a KL's cost)."""
    widths: dict[tuple[int, str], int]
    group_size: int = 64
    value_group: int = 64
    residual: int = 64
    stride: int = 1


def _quantized(x: torch.Tensor, bits: int, kind: str, r: Reader) -> torch.Tensor:
    """x [B, H, T, D] (B = 1) -> its complete pages as KIVI stores them at `bits` (the open page as is)."""
    t = x[0].transpose(0, 1).float()  # [T, H, D]
    rot = kind == "v" and bits in VALUES_ROTATED.get("kivi", ())
    if rot:
        R = block_hadamard(t.shape[-1])
        t = t @ R
    c = kivi_bits(t, t, bits=bits, group_size=r.group_size, value_group=min(r.value_group, t.shape[-1]),
                  residual=0)
    out = c.k_hat if kind == "k" else c.v_hat
    if rot:
        out = out @ R.T
    return out.transpose(0, 1)[None].to(x.dtype)


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def read_mask(T: int, r: Reader, device) -> torch.Tensor:
    """[T, T] True where query t reads key j from the packed pages: j's page ends before t's fp16 window."""
    pages = torch.arange(T, device=device) // r.group_size
    return pages[None, :] < (pages[:, None] - r.residual // r.group_size)


def make_attention(reader: Reader):
    """An attention function (transformers' AttentionInterface) that reads as kvq's decode does for the layers and
    tensors `reader` quantizes, eagerly and exactly otherwise."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        kb, vb = reader.widths.get((layer, "k")), reader.widths.get((layer, "v"))
        groups = query.shape[1] // key.shape[1]
        T = query.shape[2]
        scores = query @ _repeat(key, groups).transpose(2, 3) * scaling
        use = read_mask(T, reader, query.device) if (kb or vb) else None
        if kb:
            packed = query @ _repeat(_quantized(key, kb, "k", reader), groups).transpose(2, 3) * scaling
            scores = torch.where(use, packed, scores)
        softcap = kwargs.get("softcap")
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, :T]
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        v = _repeat(value, groups)
        if vb:
            out = (p * ~use) @ v + (p * use) @ _repeat(_quantized(value, vb, "v", reader), groups)
        else:
            out = p @ v
        return out.transpose(1, 2).contiguous(), p

    return attention


def install(model, reader: Reader) -> None:
    """Route the model's attention through the simulated read (eager masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, make_attention(reader))
    AttentionMaskInterface.register(NAME, eager_mask)
    model.config._attn_implementation = NAME
    for m in model.modules():
        if hasattr(m, "config") and m.config is not model.config and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = NAME


def kl(logits_ref: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(ref || other) of the next-token distributions, logits [1, scored positions, vocab]."""
    a = torch.log_softmax(logits_ref[0].float(), -1)
    b = torch.log_softmax(logits[0].float(), -1)
    return float((a.exp() * (a - b)).sum(-1).mean())


def first_read_position(r: Reader) -> int:
    """The first position whose read includes a packed page."""
    return r.group_size * (1 + r.residual // r.group_size)


def scored_positions(r: Reader, tokens: int) -> torch.Tensor:
    """The positions a KL scores: every stride-th one from the first that reads a packed page (the model's
    logits_to_keep)."""
    return torch.arange(first_read_position(r), tokens, r.stride)


class LayerOutputs:
    """The decoder layers' outputs of one reference pass, to skip the layers before the first quantized one: they
    compute the same whatever the layers after them read."""

    def __init__(self, model, ids: torch.Tensor, keep: torch.Tensor):
        """keep: the positions whose logits are kept (scored_positions)."""
        install(model, Reader({}))
        self.layers = decoder_layers(model)
        self.out: list = [None] * len(self.layers)
        hooks = [layer.register_forward_hook(lambda m, a, out, i=i: self.out.__setitem__(i, out))
                 for i, layer in enumerate(self.layers)]
        try:
            with torch.no_grad():
                self.logits = model(input_ids=ids, logits_to_keep=keep).logits
        finally:
            for h in hooks:
                h.remove()

    def skipping(self, first: int):
        """A context in which layers 0 .. first-1 return their reference outputs without computing."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            for i in range(first):
                self.layers[i].forward = lambda *a, i=i, **k: self.out[i]
            try:
                yield
            finally:
                for i in range(first):
                    del self.layers[i].forward
        return ctx()


def decoder_layers(model) -> list:
    inner = model.model if hasattr(model, "model") else model
    inner = getattr(inner, "language_model", inner)
    return list(inner.layers)


def model_kl(model, ids: torch.Tensor, reader: Reader, reference: torch.Tensor,
             cached: LayerOutputs | None = None) -> float:
    """KL of the model reading as `reader` says against the reference logits (at scored_positions); with `cached`,
    the layers before the first one it quantizes are not recomputed."""
    install(model, reader)
    first = min((layer for layer, _ in reader.widths), default=0) if cached is not None else 0
    keep = scored_positions(reader, ids.shape[1])
    with torch.no_grad():
        if first:
            with cached.skipping(first):
                logits = model(input_ids=ids, logits_to_keep=keep).logits
        else:
            logits = model(input_ids=ids, logits_to_keep=keep).logits
    return kl(reference, logits)


def bytes_per_token(widths: dict[tuple[int, str], int], heads: int, head_dim: int, r: Reader) -> float:
    """Packed bytes per token of the widths, from KIVI's pages as the layout declares them (layout.kivi_shapes: one
    page's codes, scales and zeros over its G tokens, keys and values split as the pool counts them), summed over
    the layers and K / V they name."""
    g = PageGeometry(P=1, G=r.group_size, H=heads, D=head_dim, NG=head_dim // min(r.value_group, head_dim))

    def per_token(bits: int, kind: str) -> float:
        return sum(math.prod(dims) * dtype.itemsize for name, (dims, dtype) in kivi_shapes(g, bits).items()
                   if counts_as_value(name) == (kind == "v")) / r.group_size

    return sum(per_token(b, kind) for (_, kind), b in widths.items())


def allocate(sensitivity: dict[tuple[int, str], dict[int, float]], target_bits: float) -> dict[tuple[int, str], int]:
    """Greedy: from every tensor at its widest measured width, step down the one whose next width adds the least KL
    per bit saved, until the mean width is at most target_bits. -> {(layer, kind): bits}."""
    widths = {key: max(s) for key, s in sensitivity.items()}
    n = len(widths)
    while sum(widths.values()) / n > target_bits + 1e-9:
        best, cost = None, math.inf
        for key, b in widths.items():
            lower = [w for w in sensitivity[key] if w < b]
            if not lower:
                continue
            w = max(lower)
            c = (sensitivity[key][w] - sensitivity[key][b]) / (b - w)
            if c < cost:
                best, cost = (key, w), c
        if best is None:
            raise ValueError(f"no allocation reaches a mean of {target_bits} bits with widths "
                             f"{sorted({w for s in sensitivity.values() for w in s})}")
        widths[best[0]] = best[1]
    return widths
