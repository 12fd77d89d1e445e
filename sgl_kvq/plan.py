"""The plan vocabulary: the types every builder produces and every reader (reference, kernels, backends) consumes.

Shapes refer to sgl_kvq/layout.py (B requests in the batch, T tokens written, G tokens per page, S token slots, P
pool pages, F overlay frames). Who builds what:

    LayerKV       QuantizedKVStore.layer_view                   one layer's pool tensors
    BatchWrite    sgl_kvq.metadata.host.begin_batch             where a batch's tokens go (host, any batch)
    PagedPlan     sgl_kvq.metadata.host.plan_contexts           what each request attends to (host)
                  sgl_kvq.metadata.device.build_decode          the same for a decode batch, on the device
    DecodeWrite   sgl_kvq.metadata.device.build_decode          where a decode batch's tokens go (device)
    Step          sgl_kvq.metadata.forward.build_forward_plan   one write + one plan, run by every layer
    PagedReread   sgl_kvq.metadata.forward.build_forward_plan   a paged prefill's one step: what it reads quantized
    ForwardPlan   sgl_kvq.metadata.forward.build_forward_plan   a forward batch's steps
    DecodePlan    sgl_kvq.kernels.decode_attention.plan         a PagedPlan cut into split-KV runs

Only types live here: no builder, no allocation. The capacity-sized buffers that back a DecodeWrite/PagedPlan
under CUDA graphs (metadata.device.DecodeBuffers) and the decode kernel's split-KV scratch
(kernels.decode_attention.DecodeWorkspace) stay beside the code that fills them.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import NamedTuple

import torch


@dataclass
class LayerKV:
    """One layer's view of the pool (sgl_kvq/layout.py with the layer dim removed)."""
    k_codes: torch.Tensor  # [S, H, Dp] uint8 keys, k_bits-bit codes packed along D
    # The four below are None for a format whose base is not KIVI's (Format.base_shapes): its scales are extras.
    k_scale: torch.Tensor | None  # [P, H, D] fp16 per page and channel
    k_zero: torch.Tensor | None  # [P, H, D] fp16
    v_codes: torch.Tensor  # [S, H, Dp] uint8 values, v_bits-bit codes packed along D
    v_scale: torch.Tensor | None  # [S, H, D // VG] fp16 per token and channel group
    v_zero: torch.Tensor | None  # [S, H, D // VG] fp16
    ov_k: torch.Tensor  # [F, G, H, D] model dtype: the fp16 overlay frames
    ov_v: torch.Tensor  # [F, G, H, D]
    k_bits: int  # code width of k_codes
    v_bits: int  # code width of v_codes (a recipe's layer may differ from its keys': sgl_kvq/recipe.py)
    # The tensors the format adds to each page (its Format.extras NamedTuple, shaped as its page_shapes declare:
    # GEAR's PageCorrection, LogQuant's PageRows, ZipCache's SalientPlane); None for KIVI's pages alone. Its type
    # names the format (formats.registry.of_extras).
    extras: NamedTuple | None = None

    @property
    def G(self) -> int:
        return self.ov_k.shape[1]


@dataclass
class PagedPlan:
    """What each request attends to: FlashInfer's paged metadata, split in two page lists per request. A request's
    context is its base pages followed by its overlay frames, in position order; only its last page (base or
    overlay, whichever list ends the context) may be partial. All int32, on the pool's device."""
    kv_indptr: torch.Tensor  # [B + 1] request b's base pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    kv_indices: torch.Tensor  # [nnz] pool page ids (quantized, immutable pages)
    kv_last_page_len: torch.Tensor  # [B] tokens used in b's last base page (G unless b has no overlay frames)
    ov_indptr: torch.Tensor  # [B + 1] request b's overlay frames are ov_indices[ov_indptr[b]:ov_indptr[b + 1]]
    ov_indices: torch.Tensor  # [nnz_ov] overlay frame ids (fp16 copies of b's most recent pages)
    ov_last_page_len: torch.Tensor  # [B] tokens used in b's last frame (1..G; 0 when b has none)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.numel() - 1

    def base_len(self, b: int, G: int) -> int:
        n = int(self.kv_indptr[b + 1] - self.kv_indptr[b])
        return 0 if n == 0 else (n - 1) * G + int(self.kv_last_page_len[b])

    def overlay_len(self, b: int, G: int) -> int:
        n = int(self.ov_indptr[b + 1] - self.ov_indptr[b])
        return 0 if n == 0 else (n - 1) * G + int(self.ov_last_page_len[b])

    def seq_len(self, b: int, G: int) -> int:
        return self.base_len(b, G) + self.overlay_len(b, G)


@dataclass
class BatchWrite:
    """Where one batch's tokens go; built once per batch (host-side) and used by every layer. All int64; "rows" are
    indices into the batch's T written tokens."""
    slots: torch.Tensor  # [T] pool token slots (SGLang's out_cache_loc)
    frame_rows: torch.Tensor  # [Tf] rows of tokens kept in the overlay (the request's last `ring` pages)
    frame_ids: torch.Tensor  # [Tf] their frames
    frame_offs: torch.Tensor  # [Tf] their in-page offsets
    done_pages: torch.Tensor  # [N] pool pages completed by this batch (quantized into the base by write_layer)
    done_frames: torch.Tensor  # [N] the frame holding each completed page's earlier tokens
    done_tok_rows: torch.Tensor  # [M] rows of tokens that belong to completed pages
    done_tok_page: torch.Tensor  # [M] index into done_pages of each such row
    done_tok_off: torch.Tensor  # [M] its offset in the page
    done_lpages: torch.Tensor | None = None  # [N] each completed page's logical page index (LogQuant's rows)


@dataclass
class DecodeWrite:
    """Where one decode batch's new tokens go (device-side, fixed shape [B]); every row goes to its frame, since a
    decode token's page is always within the recent window. All int32."""
    frame_ids: torch.Tensor  # [B] overlay frame of row b's token
    frame_offs: torch.Tensor  # [B] its offset in the page
    done_pages: torch.Tensor  # [B] pool page row b completes, 0 if none (quantized after the frame write)
    done_lpages: torch.Tensor | None = None  # [B] logical page index of row b's token's page (LogQuant's rows)


@dataclass
class PagedReread:
    """KVQ_PREFILL=paged as one step (sgl_kvq/metadata/forward.py): a new token at position i, in logical page
    j = i // G, reads pages max(first_page[b], j - ring + 1) .. j in fp16 (the step's plan's frames, then the new
    tokens) and every page before that quantized, as decode will: the plan's base pages, then `pages[b]`, read
    from the base after the step's write has quantized them."""
    first_page: list[int]  # [B] request b's first logical page the step's plan reads from its frames
    pages: list[torch.Tensor]  # [B] int64 pool ids of b's logical pages first_page[b], ... that a new token reads
    #                            quantized (the last is new token (s - 1)'s page - ring, s b's length after the step)
    ring: int  # pages in the fp16 window (KVQConfig.ring_pages)


@dataclass(kw_only=True)
class Step:
    """One write and one plan that every layer runs in order: attend (extend: before the write), then write."""
    plan: PagedPlan  # decode: the whole context after this token; extend: the context before the step's tokens
    write: BatchWrite | DecodeWrite | None = None  # None: a read-only lane that writes nothing
    rows: torch.Tensor | None = None  # rows of the batch's q/k/v in this step (None: all rows, in order)
    qo_indptr: torch.Tensor | None = None  # extend: [B + 1] int32, request b's step tokens are step rows
    #                                        qo_indptr[b]:qo_indptr[b + 1]
    max_qo_len: int = 1  # extend: the most step tokens of one request (sizes the kernel grid without a sync)
    reread: PagedReread | None = None  # extend: a paged prefill in one step (attend after the write), else None


@dataclass(kw_only=True)
class ForwardPlan:
    """A forward batch's steps: one for decode and "full" prefill; for "paged" prefill one per touched page, or one
    with a PagedReread where the backend attends to a whole paged extend at once (kvq_torch)."""
    is_decode: bool
    steps: list[Step]


@dataclass
class DecodePlan:
    """A PagedPlan cut into split-KV runs for the decode kernel (built by kernels.decode_attention.plan)."""
    paged: PagedPlan  # the six int32 page-list tensors, on the pool's device
    num_splits: torch.Tensor  # [B] int32, 1..max_splits: request b's pages are cut into this many contiguous runs
    max_splits: int  # static grid extent along splits
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    o_partial: torch.Tensor  # [B, Hq, max_splits, D] fp32 workspace (reused by every layer)
    lse_partial: torch.Tensor  # [B, Hq, max_splits] fp32 workspace

    @property
    def batch_size(self) -> int:
        return self.num_splits.numel()
