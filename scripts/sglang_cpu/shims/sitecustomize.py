"""Test scaffolding: SGLang's LoRA layers and its torch_native LoRA backend ask for pinned host memory
(`pin_memory=True`, `.pin_memory()`), which torch refuses without CUDA ("pin_memory=True requires a CUDA
or other accelerator backend") and the scheduler dies at start. Without CUDA, pinning is made a no-op:
pinned memory only speeds host-to-GPU copies, and here there is no GPU. torch is patched once it has
imported, not imported here: SGLang sets its environment before it loads torch."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

# torch's factory functions that take pin_memory= (the ones SGLang's LoRA code calls, and their kin)
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
             "full_like", "empty_strided", "randn", "rand")


def _unpinned(fn):
    def call(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "call")
    return call


def patch(torch) -> None:
    if torch.cuda.is_available():
        return
    for name in FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds torch as the other finders do, and patches it once its module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and not for the lookup below
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:
    patch(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _AfterTorch())
