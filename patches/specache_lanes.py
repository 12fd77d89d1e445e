"""AROUND hook on SGLang's eager decode forward (EagerRunner._execute_decode): a decode step of a specache pool
runs as SpeCache's two lanes (sgl_kvq/specache/lanes.py, which says why a doubled decode and not TARGET_VERIFY);
every other forward, and every other pool, runs unchanged."""

from __future__ import annotations

from sgl_kvq.specache.lanes import run_lanes


def execute_decode(orig, self, forward_batch, pp_proxy_tensors=None, *args, **kwargs):
    sc = getattr(self.model_runner.token_to_kv_pool, "specache", None)
    if sc is None or not forward_batch.forward_mode.is_decode():
        return orig(self, forward_batch, pp_proxy_tensors, *args, **kwargs)
    return run_lanes(lambda: orig(self, forward_batch, pp_proxy_tensors, *args, **kwargs), forward_batch, sc)
