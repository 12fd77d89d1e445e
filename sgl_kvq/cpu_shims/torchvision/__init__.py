"""CPU import shim of torchvision (see ../README.md): import only."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
try:
    import _placeholder  # noqa: E402
finally:
    sys.path.pop(0)

_placeholder.install(__name__, "0.0.0+cpushim")
