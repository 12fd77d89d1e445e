"""CPU import shim of sgl_kernel (see ../README.md): names import, calls raise."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
try:
    import _placeholder  # noqa: E402
finally:
    sys.path.pop(0)

_placeholder.install(__name__, "0.4.10+cpushim")
