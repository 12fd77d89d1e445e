"""The errors sgl_kvq raises: bad input before a model loads (a dtype name, a knob, a flag combination), and
tensors that break the packed layout at a kernel's boundary."""


class KVQConfigError(ValueError):
    """Bad sgl_kvq input: raised before any model loads."""


class LayoutError(ValueError):
    """Tensors handed to a kernel that do not match the packed layout their format declares."""
