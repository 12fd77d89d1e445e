"""Placeholder modules for the CPU shims: importable, any attribute resolves, calling one fails loudly."""

import importlib.abc
import importlib.machinery
import sys
import types


class ShimCalledError(RuntimeError):
    pass


class Placeholder:
    """Stands for a name from a package that has no CPU build; usable as a base class, a decorator target or a
    default value, but calling it raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise ShimCalledError(f"{self._qualname} was called, but it is a CPU import shim (sgl_kvq/cpu_shims): "
                              "this op has no CPU implementation")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._qualname}.{name}")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<cpu shim {self._qualname}>"


class ShimModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str):
        self.prefix = root + "."

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = ShimModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install(module_name: str, version: str) -> None:
    """Turn the (already executing) package `module_name` into a placeholder package with shim submodules."""
    module = sys.modules[module_name]
    module.__class__ = ShimModule
    module.__version__ = version
    sys.meta_path.insert(0, _SubmoduleFinder(module_name))
