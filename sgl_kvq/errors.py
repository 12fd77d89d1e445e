"""The error every bad sgl_kvq input raises before a model loads (a dtype name, a knob, a flag combination)."""


class KVQConfigError(ValueError):
    """Bad sgl_kvq input: raised before any model loads."""
