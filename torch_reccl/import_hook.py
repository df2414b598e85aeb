"""One-shot import hooks: run code right after a module loads, without importing it.

``backend.py`` registers the "reccl" backend the moment torch.distributed loads
(so ``import torch_reccl`` need not import torch); the Megatron-LM launcher
(examples/megatron) adapts a Megatron module the moment Megatron imports it.
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and wraps its loader so that
    ``callback(module)`` runs once the module's code has run; then leaves."""

    def __init__(self, name: str, callback: Callable):
        self.name = name
        self.callback = callback

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        callback = self.callback

        def exec_then_call(module):
            exec_module(module)
            callback(module)

        spec.loader.exec_module = exec_then_call
        return spec


def after_import(name: str, callback: Callable) -> None:
    """Calls ``callback(module)`` right after module ``name`` is next imported, once.
    Does not import it; the same callback already waiting for ``name`` is not added again."""
    if not any(isinstance(finder, _AfterImport) and finder.name == name and finder.callback == callback
               for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
