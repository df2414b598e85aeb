"""The ``"reccl"`` torch.distributed backend (CPU tensors).

Importing :mod:`torch_reccl` registers it, so::

    import torch_reccl
    import torch.distributed as dist
    dist.init_process_group("reccl")          # torchrun's env://, or store=..., init_method=...

Collective data flows only over the ``RECCL_NICS`` NICs, through connections that
fail over to a backup NIC; the store (and so the rendezvous) uses whatever address
the caller gave. Engine settings that must be the same on every rank are given as
``pg_options``::

    dist.init_process_group("reccl", pg_options=torch_reccl.backend.Options(channels=4))

See ``docs/collectives.md``.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.abc
import sys
import warnings
from typing import Any, Dict

BACKEND_NAME = "reccl"


@dataclasses.dataclass
class Options:
    """Engine settings of one process group; every rank must pass the same values.

    channels: connections per peer pair and direction, channel ``c`` pinned to NIC
        ``c % len(RECCL_NICS)`` (0: one per NIC); 1..64.
    chunk_bytes: pipelining unit of the ring algorithms; 4096..268435456.
    window: chunks each channel receives ahead; 1..64.
    """

    channels: int = 0
    chunk_bytes: int = 1 << 20
    window: int = 4

    def __post_init__(self) -> None:
        if not (isinstance(self.channels, int) and 0 <= self.channels <= 64):
            raise ValueError(f"channels={self.channels!r} is not valid: expected 0 (one per NIC) or 1..64")
        if not (isinstance(self.chunk_bytes, int) and 4096 <= self.chunk_bytes <= 256 << 20):
            raise ValueError(f"chunk_bytes={self.chunk_bytes!r} is not valid: expected 4096..268435456")
        if not (isinstance(self.window, int) and 1 <= self.window <= 64):
            raise ValueError(f"window={self.window!r} is not valid: expected 1..64")


def _pg_native():
    """The extension module that has the process group."""
    from torch_reccl._native import native

    module = native()
    if not hasattr(module, "_create_reccl_backend"):
        raise ImportError("torch_reccl._C was built without the process group; rebuild with "
                          "`python setup.py build_ext --inplace`")
    return module


def _seconds(timeout: Any) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    return float(timeout)


def _create_backend(dist_options, pg_options):
    """The creator torch.distributed calls (extended API) for every reccl group."""
    options = pg_options if isinstance(pg_options, Options) else Options()
    return _pg_native()._create_reccl_backend(
        dist_options.store,
        dist_options.group_rank,
        dist_options.group_size,
        _seconds(dist_options.timeout),
        str(dist_options.group_id),
        options.channels,
        options.chunk_bytes,
        options.window,
    )


def register() -> None:
    """Registers the backend with torch.distributed (idempotent). Imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not hasattr(dist, "Backend"):
        import torch.distributed as dist
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])
    # Load the library now, so NCCL's dlopen of the plugin (NCCL_NET_PLUGIN) finds
    # it already loaded by Python rather than loading it first.
    _pg_native()


class _RegisterWhenLoaded(importlib.abc.MetaPathFinder):
    """One-shot import hook: registers the backend right after torch.distributed
    loads (``import torch`` loads it), so ``import torch_reccl`` need not import torch."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
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

        def exec_and_register(module):
            exec_module(module)
            try:
                register()
            except Exception as error:  # noqa: BLE001 - never break `import torch`
                warnings.warn(f"torch_reccl could not register the reccl backend: {error}", stacklevel=2)

        spec.loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Registers "reccl" now if torch.distributed is loaded, else as soon as it loads."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "Backend"):
        register()
    elif not any(isinstance(finder, _RegisterWhenLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLoaded())


def backend_info(group=None) -> Dict[str, Any]:
    """Engine facts of a reccl group's CPU backend: channels, chunk_bytes, window, ops_done."""
    import torch
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    return _pg_native()._reccl_backend_info(pg._get_backend(torch.device("cpu")))


install()
