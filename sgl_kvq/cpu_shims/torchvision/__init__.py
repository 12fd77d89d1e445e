"""CPU import shim of torchvision (see ../README.md): import only."""

from sgl_kvq.cpu_shims import _placeholder

_placeholder.install(__name__, "0.0.0+cpushim")
