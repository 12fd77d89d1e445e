"""Triton kernels of sgl_kvq: each @triton.jit kernel file beside its launcher; no SGLang imports."""
