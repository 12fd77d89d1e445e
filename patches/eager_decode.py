"""AROUND hook on SGLang's eager decode forward (EagerRunner._execute_decode): a decode step of a kvq pool whose
decode strategy runs in the eager forward (DecodeStrategy.eager_decode: SpeCache's two lanes,
sgl_kvq/specache/lanes.py, which says why a doubled decode and not TARGET_VERIFY) runs through that strategy;
every other forward, and every other pool, runs unchanged."""

from __future__ import annotations


def execute_decode(orig, self, forward_batch, pp_proxy_tensors=None, *args, **kwargs):
    pool = self.model_runner.token_to_kv_pool
    strategy = getattr(pool, "strategy", None)  # SGLang's own pools have none

    def forward():
        return orig(self, forward_batch, pp_proxy_tensors, *args, **kwargs)

    if strategy is None or not strategy.eager_decode or not forward_batch.forward_mode.is_decode():
        return forward()
    return strategy.eager_decode_step(forward, forward_batch, pool.strategy_state)
