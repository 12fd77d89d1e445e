"""Register the kvq attention backends with SGLang's registry (the factories run in the scheduler process)."""

from __future__ import annotations

import importlib.util


def triton_backend_available() -> bool:
    return importlib.util.find_spec("sgl_kvq.backends.triton_backend") is not None


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    @register_attention_backend("kvq_torch")
    def create_kvq_torch_backend(runner):
        return backend_class(_strategy_name(runner), "kvq_torch")(runner)

    if triton_backend_available():

        @register_attention_backend("kvq_triton")
        def create_kvq_triton_backend(runner):
            return backend_class(_strategy_name(runner), "kvq_triton")(runner)


def backend_class(strategy: str, backend: str) -> type:
    """The class serving attention backend `backend` ("kvq_torch", "kvq_triton") under decode strategy `strategy`
    (Format.strategy: the pool alone, or SpeCache's two lanes)."""
    return _CLASSES[strategy][backend]()


# Imported when the factory runs, so that a process serving kvq_torch never imports the Triton kernels.
def _torch():
    from sgl_kvq.backends.torch_backend import KVQTorchBackend

    return KVQTorchBackend


def _triton():
    from sgl_kvq.backends.triton_backend import KVQTritonBackend

    return KVQTritonBackend


def _two_lanes_torch():
    from sgl_kvq.backends.specache_backend import KVQSpeCacheBackend

    return KVQSpeCacheBackend


def _two_lanes_triton():
    from sgl_kvq.backends.specache_triton_backend import KVQSpeCacheTritonBackend

    return KVQSpeCacheTritonBackend


_CLASSES = {"pool": {"kvq_torch": _torch, "kvq_triton": _triton},
            "specache": {"kvq_torch": _two_lanes_torch, "kvq_triton": _two_lanes_triton}}


def _strategy_name(runner) -> str:
    """The decode strategy of the runner's kvq pool; a pool that is not a kvq pool gets the plain backends (which
    refuse it with their own error)."""
    cfg = getattr(runner.token_to_kv_pool, "cfg", None)
    return "pool" if cfg is None else cfg.format.strategy
