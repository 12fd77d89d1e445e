"""Kernels of sgl_kvq, each beside its launcher, no SGLang imports: the Triton kernels (@triton.jit files) and
the CPU decode kernel in C (cpu_decode_attention.c, compiled by its launcher)."""
