"""Register the kvq attention backends with SGLang's registry (the factories run in the scheduler process)."""

from __future__ import annotations

import importlib.util


def triton_backend_available() -> bool:
    return importlib.util.find_spec("sgl_kvq.backends.triton_backend") is not None


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    @register_attention_backend("kvq_torch")
    def create_kvq_torch_backend(runner):
        if getattr(runner.token_to_kv_pool, "specache", None) is not None:
            from sgl_kvq.backends.specache_backend import KVQSpeCacheBackend

            return KVQSpeCacheBackend(runner)
        from sgl_kvq.backends.torch_backend import KVQTorchBackend

        return KVQTorchBackend(runner)

    if triton_backend_available():

        @register_attention_backend("kvq_triton")
        def create_kvq_triton_backend(runner):
            if getattr(runner.token_to_kv_pool, "specache", None) is not None:
                from sgl_kvq.backends.specache_triton_backend import KVQSpeCacheTritonBackend

                return KVQSpeCacheTritonBackend(runner)
            from sgl_kvq.backends.triton_backend import KVQTritonBackend

            return KVQTritonBackend(runner)
