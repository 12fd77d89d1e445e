"""Every hook sgl_kvq places into SGLang; the only package that imports SGLang internals."""
