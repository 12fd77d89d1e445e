"""Prefill/decode disaggregation hooks (sgl_kvq/pd_transfer.py says what the packed pool sends and why).

mooncake_sender_init: SGLang's prefill side copies a request's page indices into pinned host memory and records a
CUDA event when its mooncake sender `supports_host_tensor_indices` (prefill.py `_send_kv_chunk`); without CUDA that
dies with "pin_memory=True requires a CUDA or other accelerator backend" on the first request, bf16 included. On a
machine without CUDA the sender takes SGLang's other branch (plain `kv_to_page_indices`), whatever the KV dtype.

setup_state_kv_args, ensure_parallel_info: both sides publish the packed pool's fingerprint (KVQConfig.fingerprint:
dtype, G, value group, R, rotation, the format's parameters) as SGLang's kv_layout, which the decode side compares
with the prefill side's when it first contacts it and refuses the pair if they differ: pages written under one
fingerprint would be read as another's (two servers with different KVQ_ROTATE would decode garbage). The refusal
names both fingerprints and the parts that differ.

prefill_early_send: with a radix hit SGLang sends the cached prefix's pages before the forward, after recording a
CUDA event on the forward stream ("Tried to instantiate dummy base class Event" without CUDA, on the second request
that shares a prefix). Without CUDA that optional early send is skipped: the final send covers the prefix too.
"""

from __future__ import annotations

import re
import threading

# Bytes this process's mooncake engine wrote to a peer, KV (pages and request state) and aux (the first token,
# logprobs: SGLang's metadata buffers) apart, and the requests whose last KV chunk it was handed: the prefill
# server reports them in its pool stats (patches/observability.py) so a PD run measures what went over the wire,
# not what the descriptions promise.
SENT = {"kv_bytes": 0, "aux_bytes": 0, "batches": 0, "requests": 0}
_lock = threading.Lock()
_in_aux = threading.local()


LAYOUT_PREFIX = "sgl_kvq:"


class KVQPDMismatch(RuntimeError):
    pass


def publish_layout(kv_args, pool) -> None:
    """The pool's fingerprint as the KV manager's kv_layout (published to the bootstrap server by the prefill side,
    compared by the decode side)."""
    if getattr(kv_args, "kv_layout", None) is None:
        kv_args.kv_layout = LAYOUT_PREFIX + pool.cfg.fingerprint


def fingerprint_mismatch(prefill: str, decode: str) -> str:
    """The refusal of a PD pair whose packed pools differ: both fingerprints and the parts that differ."""
    a, b = (x.removeprefix(LAYOUT_PREFIX).split("_") for x in (prefill, decode))
    differ = [f"{x} vs {y}" for x, y in zip(a, b) if x != y] + [f"{x} vs -" for x in a[len(b):]] + \
        [f"- vs {y}" for y in b[len(a):]]
    return (f"sgl_kvq: the prefill server stores KV pages as {prefill.removeprefix(LAYOUT_PREFIX)}, the decode "
            f"server as {decode.removeprefix(LAYOUT_PREFIX)} (they differ in {'; '.join(differ)}): the decode server "
            "would read the prefill's pages in another format. Start both with the same --kv-cache-dtype and KVQ_* "
            "variables")


def ensure_parallel_info(orig, manager, bootstrap_addr, *args, **kwargs):
    """Decode side: SGLang's own comparison of the two kv_layouts, refused in sgl_kvq's words when both are
    packed pools."""
    try:
        return orig(manager, bootstrap_addr, *args, **kwargs)
    except RuntimeError as e:
        match = re.search(r"prefill server has kv_layout=(\S+), but decode server has kv_layout=(\S+)\.", str(e))
        if match and match[1].startswith(LAYOUT_PREFIX) and match[2].startswith(LAYOUT_PREFIX):
            raise KVQPDMismatch(fingerprint_mismatch(match[1], match[2])) from e
        raise


def mooncake_sender_init(result, sender, *args, **kwargs):
    import torch

    if not torch.cuda.is_available():
        sender.supports_host_tensor_indices = False


def prefill_early_send(orig, scheduler, *args, **kwargs):
    import torch

    if torch.cuda.is_available():
        return orig(scheduler, *args, **kwargs)
    return None


def _kvq_pool(pool):
    from sgl_kvq.pool import KVQTokenToKVPool

    return pool if isinstance(pool, KVQTokenToKVPool) else None


def setup_state_kv_args(result, kv_args, token_to_kv_pool, *args, **kwargs):
    """Both sides, before the KV manager is built from kv_args: the packed pool's request state (its overlay frames
    and pd_window counts) is one REQUEST_ROW component, which SGLang sends from the prefill's request slot to the
    decode's (sgl_kvq/pd_transfer.py), and its fingerprint is the kv_layout (publish_layout)."""
    pool = _kvq_pool(token_to_kv_pool)
    if pool is None:
        return
    publish_layout(kv_args, pool)
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    from sgl_kvq.pd_transfer import request_state_layer_ids

    append_state_component(kv_args, StateType.REQUEST_ROW, *pool.get_request_state_buf_infos(),
                           layer_ids=request_state_layer_ids(pool.store, pool.start_layer))


def _request_pages(req_to_token, req_slot: int, seq_len: int, G: int):
    return req_to_token[req_slot, :seq_len:G].cpu() // G


def sent_stats() -> dict | None:
    """SENT with the bytes per request, or None where nothing was sent (not a PD prefill server)."""
    with _lock:
        sent = dict(SENT)
    if not sent["batches"]:
        return None
    sent["bytes_per_request"] = (sent["kv_bytes"] + sent["aux_bytes"]) / sent["requests"] if sent["requests"] else None
    return sent


def prefill_send_kv_chunk(scheduler, req, last_chunk: bool = False, end_idx=None):
    """Prefill side, before the last chunk (the one that carries the request state) is sent: count the request
    (SENT) and the frames that hold it (pd_transfer.mark_window)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    # warmup and health-check requests go to a fake sender that sends nothing (SGLang skips them in its own
    # KV transfer metrics too)
    if last_chunk and req.bootstrap_host != FAKE_BOOTSTRAP_HOST:
        with _lock:
            SENT["requests"] += 1
    pool = _kvq_pool(scheduler.token_to_kv_pool_allocator.get_kvcache())
    if pool is None or not last_chunk or req.kv.req_pool_idx is None:
        return
    from sgl_kvq.pd_transfer import mark_window

    seq_len = min(req.extend_end, len(req.origin_input_ids))
    slot = int(req.kv.req_pool_idx)
    pages = _request_pages(scheduler.req_to_token_pool.req_to_token, slot, seq_len, pool.store.G)
    mark_window(pool.store, slot, pages, seq_len)


def decode_commit_transfer(result, queue, decode_req):
    """Decode side, once a request's pages and state have arrived: its frames hold this side's pages
    (pd_transfer.adopt_frames). An aborted transfer is left alone."""
    from sglang.srt.disaggregation.utils import is_aborted

    scheduler, req = queue.scheduler, decode_req.req
    pool = _kvq_pool(scheduler.token_to_kv_pool_allocator.get_kvcache())
    if pool is None or is_aborted(req):
        return
    from sgl_kvq.pd_transfer import adopt_frames

    seq_len = len(req.origin_input_ids)
    slot = int(req.kv.req_pool_idx)
    pages = _request_pages(scheduler.req_to_token_pool.req_to_token, slot, seq_len, pool.store.G)
    adopt_frames(pool.store, slot, pages, seq_len)


def count_batch_transfer(orig, engine, *args, **kwargs):
    ret = orig(engine, *args, **kwargs)
    lengths = kwargs["lengths"] if "lengths" in kwargs else args[3]
    if ret == 0:
        with _lock:
            SENT["aux_bytes" if getattr(_in_aux, "on", False) else "kv_bytes"] += int(sum(lengths))
            SENT["batches"] += 1
    return ret


def count_aux(orig, manager, *args, **kwargs):
    _in_aux.on = True
    try:
        return orig(manager, *args, **kwargs)
    finally:
        _in_aux.on = False
