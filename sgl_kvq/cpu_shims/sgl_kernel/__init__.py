"""CPU import shim of sgl_kernel (see ../README.md): names import, calls raise."""

from sgl_kvq.cpu_shims import _placeholder

_placeholder.install(__name__, "0.4.10+cpushim")
