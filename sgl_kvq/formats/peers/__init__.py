"""The KV formats the engines ship, served to compare with ours (issue 30): SGLang's fp8_e4m3, fp4_mx_block16 and
nvfp4, vLLM's int4 per token and head and TurboQuant-style 3 / 4-bit codes, named peer_* so no one takes them for
SGLang's or vLLM's own kernels. Served through kvq_torch only (kernel None: kvq_triton refuses them before the
model loads); their arithmetic is sgl_kvq/formats/peers/codecs.py, the references' (sgl_kvq/formats/peers/reference.py).

The pool stores each format at the peer's real layout, per token slot: k_codes / v_codes [S, H, Dp] (the base,
whose bytes pooled frames reuse) and the rest, scales or norms, as the format's extras [S, H, ...]. Bytes per token
are those tensors and nothing else (nvfp4's per-layer global scale is a constant 1.0, SGLang's default without
calibrated KV scales).

The open page: every token is read quantized, and there is no fp16 window (R = 0 by default). The pool's write
path keeps a request's open page in its fp16 overlay frame until the page completes, then packs it; these formats
are per token and head, so instead of a page-completion rule they read the frame's tokens through their own
quantizer (read_overlay). A token therefore reads the same codes before and after its page is packed, from the
same fp16 input, and the store, the metadata and the radix tree stay as they are for every format. What it costs:
the open page's fp16 frame per running request, as for KIVI's formats (the engines write a token's codes at once);
a token written straight into the base would need per-token writes and a partial base page in every plan. Like
KIVI's "full" prefill and the engines' own prefill, an extend's new tokens attend to each other unquantized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kvq.errors import KVQConfigError
from sgl_kvq.formats.base import Format
from sgl_kvq.formats.page_codec import PageCodec, PageWrite
from sgl_kvq.layout import PageGeometry, Shapes
from sgl_kvq.padded import gather_rows
from sgl_kvq.formats.peers import codecs


class PeerBase(NamedTuple):
    k_codes: torch.Tensor
    v_codes: torch.Tensor


class PeerCodec(PageCodec):
    """Each token's row quantized by the peer's own key and value arithmetic, whole pages at a time."""
    plain_pages = False

    def __init__(self, k: codecs.Codec, v: codecs.Codec, extras: type):
        self.k, self.v, self.extras = k, v, extras

    def pack(self, cfg, value_group: int, k, v, w: PageWrite, tables: dict):
        (kc, *ks), (vc, *vs) = self.k.quantize(k), self.v.quantize(v)
        return PeerBase(kc, vc), self.extras(*ks, *vs)

    def _split(self, extras) -> tuple[list, list]:
        nk = len(self.k.tails(64)) - 1
        return list(extras[:nk]), list(extras[nk:])

    def read_pages(self, kv, pages: torch.Tensor):
        G, H, D = kv.G, kv.ov_k.shape[2], kv.ov_k.shape[3]
        slots = (pages[:, None] * G + torch.arange(G, device=pages.device)).reshape(-1)
        ks, vs = self._split(kv.extras)
        k = self.k.dequantize(kv.k_codes[slots], *(t[slots] for t in ks))
        v = self.v.dequantize(kv.v_codes[slots], *(t[slots] for t in vs))
        return k.view(-1, G, H, D), v.view(-1, G, H, D)

    def read_padded(self, kv, ctx, ws):
        H = kv.ov_k.shape[2]
        ks, vs = self._split(kv.extras)
        off = ~ctx.is_base_tok[None, :, None]
        out = []
        for codec, codes, rest in ((self.k, kv.k_codes, ks), (self.v, kv.v_codes, vs)):
            x = codec.dequantize(gather_rows(codes, ctx.slot_rows, H),
                                 *(gather_rows(t, ctx.slot_rows, H) for t in rest))
            out.append(x.masked_fill_(off, 0))  # [H, B * U * G, D]; padding and overlay positions 0
        return out[0], out[1]

    def read_overlay(self, k, v):
        return self.k.round_trip(k), self.v.round_trip(v)


class PeerFormat(Format):
    kernel = None

    def __init__(self, family: str, bits: int, k: codecs.Codec, v: codecs.Codec, *, block: int = 1):
        """family: the dtype name (each peer format is one width); bits: the codes' width; block: channels per
        scale block (16 for the FP4 formats), of which head_dim must be a multiple."""
        self.family, self.bits, self.k, self.v, self.block = family, (bits,), k, v, block
        # The extras' NamedTuple, one type per format: a layer view's extras type names its format.
        fields = [f"{x}_{n}" for x, c in (("k", k), ("v", v)) for n in list(c.tails(64))[1:]]
        self.extras = NamedTuple(f"{family.title().replace('_', '')}Pages", [(n, torch.Tensor) for n in fields])
        self.codec = PeerCodec(k, v, self.extras)

    def dtype_name(self, bits: int) -> str:
        return self.family

    def default_knobs(self, bits: int, params=None) -> dict:
        return {**super().default_knobs(bits, params), "residual": 0}  # the engines keep no fp16 window

    def check(self, cfg) -> None:
        if cfg.rotate != "none":
            raise KVQConfigError(f"sgl_kvq: {cfg.name} is the peer's own arithmetic (its rotation, if any, is part of "
                                 f"it); KVQ_ROTATE={cfg.rotate} would make it another format. Unset KVQ_ROTATE")

    def check_head_dim(self, cfg, head_dim: int) -> None:
        if head_dim % self.block:
            raise KVQConfigError(f"sgl_kvq: {cfg.name} scales blocks of {self.block} channels; head_dim={head_dim} "
                                 "is not a multiple")

    def _tensors(self, g: PageGeometry) -> Shapes:
        return {f"{x}_{n}": ((g.S, g.H, *dims), dtype)
                for x, c in (("k", self.k), ("v", self.v)) for n, (dims, dtype) in c.tails(g.D).items()}

    def base_shapes(self, g: PageGeometry, bits: int, v_bits: int | None = None) -> Shapes:
        shapes = self._tensors(g)
        return {name: shapes[name] for name in PeerBase._fields}

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        return {n: s for n, s in self._tensors(g).items() if n not in PeerBase._fields}


FP8_E4M3 = PeerFormat("peer_fp8_e4m3", 8, codecs.Fp8E4M3(), codecs.Fp8E4M3())
FP4_MX_BLOCK16 = PeerFormat("peer_fp4_mx_block16", 4, codecs.Fp4MxBlock16(), codecs.Fp4MxBlock16(), block=16)
NVFP4 = PeerFormat("peer_nvfp4", 4, codecs.NvFp4(), codecs.NvFp4(), block=16)
INT4 = PeerFormat("peer_int4", 4, codecs.Int4PerTokenHead(), codecs.Int4PerTokenHead())
TQ3 = PeerFormat("peer_tq3", 3, codecs.TurboQuantKeys(3), codecs.TurboQuantValues(3))
TQ4 = PeerFormat("peer_tq4", 4, codecs.TurboQuantKeys(4), codecs.TurboQuantValues(4))
FORMATS = (FP8_E4M3, FP4_MX_BLOCK16, NVFP4, INT4, TQ3, TQ4)
