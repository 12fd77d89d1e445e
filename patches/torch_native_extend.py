"""SGLang's torch_native extend (the bf16 baseline on the CPU engine) attends for the new tokens alone.

TorchNativeAttnBackend._run_sdpa_forward_extend pads each request's new queries to its whole context (uninitialised
rows for the cached prefix), runs a context x context attention and keeps the new rows: a question of 30 tokens
after a cached 32k-token document costs a 32k x 32k attention per layer, and so does each chunk of that document's
prefill. Here the same attention runs for the new rows only, against the same keys and values with the same mask
(causal from the request's prefix on, SGLang's sliding-window band where the layer slides), in blocks of rows:
what SGLang keeps, at new x context cost. Encoder and cross-attention calls keep SGLang's path.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

ROWS = 2048  # query rows per attention call: a block's mask is ROWS x context booleans (64 MB at 32k)


def sdpa_forward_extend(orig, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens=None, *, scaling=None, enable_gqa=False,
                        causal=False, is_cross_attn=False, sliding_window_size=None):
    if encoder_lens is not None or is_cross_attn or not causal:
        return orig(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                    causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    window = sliding_window_size if sliding_window_size is not None and sliding_window_size > -1 else None
    heads_first = query.movedim(0, query.dim() - 2)  # [heads, tokens, head_dim]
    start = 0
    for i in range(seq_lens.shape[0]):
        new, prefix, context = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
        tokens = req_to_token[req_pool_indices[i], :context]
        key = k_cache[tokens].movedim(0, query.dim() - 2).to(query.dtype).unsqueeze(0)
        value = v_cache[tokens].movedim(0, query.dim() - 2).to(query.dtype).unsqueeze(0)
        k_pos = torch.arange(context, device=query.device).unsqueeze(0)
        for a in range(0, new, ROWS):
            b = min(a + ROWS, new)
            q_pos = torch.arange(prefix + a, prefix + b, device=query.device).unsqueeze(1)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos >= q_pos - window
            out = scaled_dot_product_attention(heads_first[:, start + a:start + b].unsqueeze(0), key, value,
                                               attn_mask=mask, enable_gqa=enable_gqa, scale=scaling)
            output[start + a:start + b] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start += new
    return output
