"""What the kernel tests share: the device they run on (CUDA when present, else the Triton interpreter on CPU),
the tolerance of each output dtype (the kernels' own arithmetic error: the quantization error is the reference's too;
bf16 only on CUDA, as bf16 tl.dot is broken in the interpreter), and the moves and the comparison they make."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def to_device(obj):
    def move(x):
        if torch.is_tensor(x):
            return x.to(DEVICE)
        return type(x)(*(t.to(DEVICE) for t in x)) if isinstance(x, tuple) else x  # GEAR's PageCorrection

    return type(obj)(**{f: move(getattr(obj, f)) for f in obj.__dataclass_fields__})


def assert_close_written(out, ref, dtype):
    assert not out.isnan().any(), "some output elements were never written (NaN poison survived)"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=rtol, atol=atol)
