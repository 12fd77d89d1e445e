"""Retraction keeps a kvq request's complete pages in the radix tree.

SGLang frees a retracted request's KV without inserting it ("TODO: for preempted requests, we may want to insert
into the tree"), so the request is re-prefilled from scratch when it resumes. With quantized KV that recompute is
not the computation the request had been doing: its generated tokens had attended to quantized pages, the
re-prefill attends to them in full precision, and the continuation changes. Checkpointing the complete pages
(already quantized, immutable) makes the resumed request read exactly the pages it read before and recompute only
its open page, as decode would have: with KVQ_PREFILL=paged and KVQ_RESIDUAL=0 a contended run then matches an
uncontended one token for token (tests/engine/test_e2e_serving.py). The pages stay evictable, so memory pressure still
frees them.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sgl_kvq")


def _is_kvq_tree(tree_cache) -> bool:
    from sgl_kvq.pool import KVQTokenToKVPool

    allocator = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    return allocator is not None and isinstance(allocator.get_kvcache(), KVQTokenToKVPool)


def release_kv_cache(orig, req, tree_cache, *args, checkpoint: bool, **kwargs):
    if not checkpoint and not req.finished() and not getattr(tree_cache, "disable", False) \
            and _is_kvq_tree(tree_cache):
        checkpoint = True
        logger.debug("sgl_kvq: checkpointing retracted request %s (%d tokens of KV)", req.rid, req.owned_kv_len())
    return orig(req, tree_cache, *args, checkpoint=checkpoint, **kwargs)
