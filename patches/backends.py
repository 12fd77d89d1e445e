"""Register the kvq attention backends with SGLang's registry (the factories run in the scheduler process)."""

from __future__ import annotations

import importlib.util


def triton_backend_available() -> bool:
    return importlib.util.find_spec("sgl_kvq.backends.triton_backend") is not None


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    @register_attention_backend("kvq_torch")
    def create_kvq_torch_backend(runner):
        return _strategy(runner).backend("kvq_torch")(runner)

    if triton_backend_available():

        @register_attention_backend("kvq_triton")
        def create_kvq_triton_backend(runner):
            return _strategy(runner).backend("kvq_triton")(runner)


def _strategy(runner):
    """The decode strategy of the runner's kvq pool (formats/strategy.py), which picks the backend class; a pool
    that is not a kvq pool gets the plain backends (which refuse it with their own error)."""
    from sgl_kvq.formats.strategy import POOL_ONLY

    cfg = getattr(runner.token_to_kv_pool, "cfg", None)
    return POOL_ONLY if cfg is None else cfg.format.strategy
