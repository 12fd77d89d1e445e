"""Prefill/decode disaggregation hooks.

mooncake_sender_init: SGLang's prefill side copies a request's page indices into pinned host memory and records a
CUDA event when its mooncake sender `supports_host_tensor_indices` (prefill.py `_send_kv_chunk`); without CUDA that
dies with "pin_memory=True requires a CUDA or other accelerator backend" on the first request, bf16 included. On a
machine without CUDA the sender takes SGLang's other branch (plain `kv_to_page_indices`), whatever the KV dtype.
"""

from __future__ import annotations


def mooncake_sender_init(result, sender, *args, **kwargs):
    import torch

    if not torch.cuda.is_available():
        sender.supports_host_tensor_indices = False
