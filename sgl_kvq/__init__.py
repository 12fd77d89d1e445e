"""sgl_kvq: low-bit KV cache for SGLang behind its radix-tree prefix sharing."""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"  # the exact release patches/ hooks; checked at import of sgl_kvq.patches
