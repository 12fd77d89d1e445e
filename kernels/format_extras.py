"""The format extras of a layer view as the attention kernels take them: one argument group built here for the
decode, extend and SpeCache launchers.

    extras, consts = format_extras(kv, geometry)
    kernel[grid](..., extras, ..., **consts)   # consts: CORRECT (a pair of jitted functions), SIZES: constexprs

`extras` is the view's page tensors of its format (LayerKV.extras, the format's NamedTuple: PageCorrection,
PageRows, SalientPlane; () for plain KIVI pages). They are checked against the shapes the format declares
(Format.page_shapes, the declaration PoolShape.base_shapes allocates from), with the format's sizes read off the
view by the format (KernelVariant.sizes_of, which also checks the bounds its correction reads). CORRECT is the format's
in-register corrections of K^T and V (KernelVariant.corrections, in its package's kernel.py), which the kernels call
on each dequantized base page; SIZES are its sizes in page_shapes' keyword order. The jitted code indexes every extra
tensor by its contiguous shape.

Nothing here or in the kernels names a format: the registry's format of the view supplies its corrections. A format
whose Format.kernel is None has no kernel: format_extras refuses its views.
"""

from __future__ import annotations

from sgl_kvq.formats.registry import of_extras
from sgl_kvq.layout import PageGeometry
from sgl_kvq.plan import LayerKV

from .checks import require


def format_extras(kv: LayerKV, g: PageGeometry) -> tuple[tuple, dict]:
    """-> (the view's extra tensors, dict(CORRECT=..., SIZES=...)) after checking them against the
    layout; an empty extra tensor (gearl2's outliers) is passed as k_scale, never read, so that no pointer is null."""
    fmt = of_extras(kv.extras)
    require(fmt.kernel is not None, f"{fmt.family} has no Triton kernel: serve it with kvq_torch")
    correct = fmt.kernel.corrections()
    if kv.extras is None:
        return (), dict(CORRECT=correct, SIZES=())
    tensors = kv.extras
    label = type(tensors).__name__
    sizes = fmt.kernel.sizes_of(tensors, g)  # LayoutError where out of its correction's bounds
    want = fmt.page_shapes(g, **sizes)
    for n, (shape, dtype) in want.items():
        t = getattr(tensors, n)
        require(tuple(t.shape) == shape and t.dtype == dtype,
                f"{label}.{n}: got {tuple(t.shape)} {t.dtype}, layout says {shape} {dtype}")
        require(t.is_contiguous() and t.device == kv.ov_k.device,
                f"{label}.{n} must be contiguous on the pool's device")
    stand_ins = {n: kv.k_scale for n in want if getattr(tensors, n).numel() == 0}
    return tensors._replace(**stand_ins), dict(CORRECT=correct, SIZES=tuple(sizes.values()))
