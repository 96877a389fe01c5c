"""Test scaffolding, not torchvision: SGLang (and transformers' image utilities, which SGLang's
config classes pull in) import torchvision's modules at load, and the package index's torchvision
is a CUDA build that clashes with the CPU torch. A text model never uses them, so every
`torchvision.*` module imports as an empty one whose names are placeholder classes."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+cpu-shim"


class _Placeholder(type):
    # A class whose attributes are placeholder classes too (enum members such as
    # InterpolationMode.BICUBIC are read at import time).
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"__module__": cls.__module__})


def _placeholder(module: str):
    def lookup(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"__module__": module})

    return lookup


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _placeholder(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Stubs())
__getattr__ = _placeholder(__name__)
