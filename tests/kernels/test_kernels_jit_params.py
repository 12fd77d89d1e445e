"""Every @triton.jit function (kernels/, the formats' corrections, the code unpacking) takes at most 40 parameters:
the attention kernels pass their tensors in argument groups (kernels/arg_groups.py, kernels/format_extras.py)
instead of one pointer and stride each."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

MAX_PARAMS = 40


def jit_functions() -> dict[str, int]:
    """'module.function' -> its parameter count, for every jitted function defined in sgl_kvq.kernels,
    sgl_kvq.formats and sgl_kvq.quant ('module' relative to its package)."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    import sgl_kvq.formats as formats
    import sgl_kvq.kernels as kernels
    import sgl_kvq.quant as quant

    found = {}
    for package in (kernels, formats, quant):
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                # under TRITON_INTERPRET=1 @triton.jit returns an InterpretedFunction wrapping the same function
                if isinstance(obj, (triton.JITFunction, InterpretedFunction)) and obj.fn.__module__ == module.__name__:
                    found[f"{info.name.removeprefix(package.__name__ + '.')}.{name}"] = \
                        len(inspect.signature(obj.fn).parameters)
    return found


def test_the_scan_finds_the_attention_kernels():
    found = jit_functions()
    for name in ("decode_attention_kernel._decode_attention_kernel", "extend_attention_kernel._extend_attention_kernel",
                 "specache_decode_kernel._specache_decode_kernel", "paged_kv_kernel._base_page_step",
                 "paged_kv_kernel._page_kt", "gear.kernel._gear_kt", "unpack_kernel._unpack"):
        assert name in found, sorted(found)


@pytest.mark.parametrize("name,count", sorted(jit_functions().items()))
def test_jit_function_has_at_most_40_parameters(name, count):
    assert count <= MAX_PARAMS, f"{name} takes {count} parameters"
