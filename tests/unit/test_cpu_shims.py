"""The CPU import shims (sgl_kvq/cpu_shims): SGLang's CPU path imports resolve; calling a shimmed op fails loudly."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from sgl_kvq.cpu_engine import cpu_engine_env

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="shims are for the CPU venv only")


def test_shims_are_the_ones_on_the_path():
    import sgl_kernel
    import torchvision

    assert sgl_kernel.__version__.endswith("+cpushim") and torchvision.__version__.endswith("+cpushim")


def test_calling_a_shimmed_op_raises():
    from sgl_kvq.cpu_shims import ShimCalledError

    sgl_kernel = importlib.import_module("sgl_kernel")
    with pytest.raises(ShimCalledError, match=r"sgl_kernel\.rmsnorm was called"):
        sgl_kernel.rmsnorm(torch.ones(2, 4), torch.ones(4))
    from sgl_kernel.flash_attn import flash_attn_with_kvcache  # a submodule that exists only as a shim

    with pytest.raises(ShimCalledError, match=r"sgl_kernel\.flash_attn\.flash_attn_with_kvcache"):
        flash_attn_with_kvcache(None)
    assert not sgl_kernel.rmsnorm  # feature checks such as `if sgl_kernel.x:` take the fallback branch


def test_sglang_cpu_engine_modules_import_with_the_shims():
    """The modules the CPU engine loads for a Llama model import, in a fresh process with SGLang's CPU platform
    (the full engine run is tests/engine/test_engine_smoke.py)."""
    code = (
        "import sglang.srt.models.llama, sglang.srt.model_executor.model_runner, sglang.srt.managers.scheduler\n"
        "import sglang.srt.layers.attention.torch_native_backend, sglang.srt.entrypoints.engine\n"
        "import sys; print(sorted(m for m in sys.modules if m.startswith('sgl_kernel')))\n"
    )
    env = {**os.environ, **cpu_engine_env(apply=False)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'sgl_kernel'" in out.stdout  # the CPU path really goes through the shim
