"""The ``"reccl"`` torch.distributed backend: CPU tensors run on the reccl
engine, CUDA tensors on torch's own ProcessGroupNCCL (through our NCCL net plugin).

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
import sys
import warnings
from typing import Any, Dict, Optional

from torch_reccl.import_hook import after_import

BACKEND_NAME = "reccl"


@dataclasses.dataclass
class Options:
    """Engine settings of one process group; every rank must pass the same values.
    ``None`` takes the value of the ``RECCL_*`` variable behind the field. Each field's
    meaning and valid range are its variable's, from the settings table
    (``python -m torch_reccl.settings``, docs/configuration.md):

    channels: ``RECCL_CHANNELS``, connections per peer pair and direction (0: one per NIC).
    chunk_bytes: ``RECCL_CHUNK_BYTES``, the pipelining unit of the rings.
    window: ``RECCL_WINDOW``, chunks each channel receives ahead.
    """

    channels: Optional[int] = None
    chunk_bytes: Optional[int] = None
    window: Optional[int] = None

    def __post_init__(self) -> None:
        from torch_reccl._native import native
        from torch_reccl.settings import option_setting

        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{field.name}={value!r} is not valid: expected an integer, or None "
                                 f"for the {option_setting(field.name)['name']} default")
            native().check_option(field.name, str(value))


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


def _cuda_backend_wanted() -> bool:
    import os

    import torch
    import torch.distributed as dist

    # A process that hides every GPU has none; asking torch would still start the
    # CUDA driver (~17 ms per process on the GPU machine) for nothing.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return dist.is_nccl_available() and torch.cuda.is_available()


def _create_cpu_backend(dist_options, options: "Options"):
    return _new_cpu_backend(dist_options.store, dist_options.group_rank, dist_options.group_size,
                            dist_options.timeout, str(dist_options.group_id), options,
                            dist_options.global_ranks_in_group)


def _new_cpu_backend(store, rank: int, size: int, timeout: Any, name: str, options: "Options",
                     global_ranks=None):
    return _pg_native()._create_reccl_backend(
        store,
        rank,
        size,
        _seconds(timeout),
        name,
        -1 if options.channels is None else options.channels,
        0 if options.chunk_bytes is None else options.chunk_bytes,
        0 if options.window is None else options.window,
        list(global_ranks or []),
    )


def cpu_process_group(store, rank: int, size: int, timeout: Any, name: str,
                      options: Optional["Options"] = None, global_ranks=None):
    """A reccl process group for CPU tensors made outside ``init_process_group``
    (what torchft's reconfigurable groups build on every quorum): a ProcessGroup
    that names itself "reccl" with the reccl engine as its one backend, for the
    "cpu" and "cuda" devices as a CPU-only reccl group registers it. ``timeout``
    bounds every op and the rendezvous (a timedelta or seconds); ``name`` appears in
    errors; ``global_ranks`` are the members' ranks in the job, for errors. Costs
    nothing until its first op, whose rendezvous goes through ``store``."""
    import torch
    from torch.distributed import ProcessGroup

    backend = _new_cpu_backend(store, rank, size, timeout, name, options or Options(), global_ranks)
    pg = _pg_native()._reccl_process_group(store, rank, size)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    for device in ("cpu", "cuda"):
        pg._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, backend)
    return pg


def _create_nccl_backend(dist_options, pg_options):
    """torch's own ProcessGroupNCCL with the caller's options (Megatron passes
    ProcessGroupNCCL.Options); NCCL loads our net plugin (see nccl_setup)."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroupNCCL

    options = pg_options if isinstance(pg_options, ProcessGroupNCCL.Options) else ProcessGroupNCCL.Options()
    options._timeout = dist_options.timeout
    options.global_ranks_in_group = list(dist_options.global_ranks_in_group or [])
    options.group_name = str(dist_options.group_id)
    store = dist.PrefixStore("cuda/", dist_options.store)
    return ProcessGroupNCCL(store, dist_options.group_rank, dist_options.group_size, options)


def _create_backend(dist_options, pg_options):
    """The creator torch.distributed calls (extended API) for every reccl group.

    CPU tensors go to the reccl engine. Where CUDA and NCCL are available, the
    group is a ProcessGroup whose CUDA backend is torch's own ProcessGroupNCCL
    (so every NCCL feature works and CUDA ops pay no dispatch cost); its NIC
    failover comes from our net plugin, its fault picture from the reccl control
    plane, which also counts the NCCL collectives issued."""
    import torch
    from torch.distributed import ProcessGroup

    options = pg_options if isinstance(pg_options, Options) else Options()
    cpu = _create_cpu_backend(dist_options, options)
    cuda = None
    if _cuda_backend_wanted():
        cuda = _create_nccl_backend(dist_options, pg_options)
        _pg_native()._reccl_attach_device_backend(cpu, cuda)
    # A ProcessGroup of our own (not the one torch would make around a returned
    # Backend) so the group names itself "reccl" to C++ callers such as DDP's
    # logging data; torch's default names a registered backend "custom"
    # (ProcessGroup::getBackendName returns backendTypeToString(CUSTOM)). torch
    # takes a ProcessGroup from the creator as the group itself
    # (distributed_c10d._new_process_group_helper), so what it would do to a
    # returned Backend happens here: the DETAIL-debug wrapper, registration.
    cpu = _debug_wrapped(dist_options, cpu)
    pg = _pg_native()._reccl_process_group(dist_options.store, dist_options.group_rank,
                                           dist_options.group_size)
    if cuda is None:
        pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
        for device in ("cpu", "cuda"):
            pg._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, cpu)
    else:
        pg._set_default_backend(ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, cpu)
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, cuda)
    return pg


def _debug_wrapped(dist_options, cpu):
    """`cpu` in torch's collective-checking wrapper under TORCH_DISTRIBUTED_DEBUG=DETAIL,
    as torch wraps every backend it registers itself."""
    import torch.distributed.distributed_c10d as c10d

    if c10d.get_debug_level() != c10d.DebugLevel.DETAIL or not c10d.is_gloo_available():
        return cpu
    return c10d._create_process_group_wrapper(
        wrapped_pg=cpu, store_prefix=str(dist_options.group_id), store=dist_options.store,
        rank=dist_options.group_rank, world_size=dist_options.group_size, timeout=dist_options.timeout)


def register() -> None:
    """Registers the backend with torch.distributed (idempotent). Imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not hasattr(dist, "Backend"):
        import torch.distributed as dist
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=["cpu", "cuda"])
    # Load the library now, so NCCL's dlopen of the plugin (NCCL_NET_PLUGIN) finds
    # it already loaded by Python rather than loading it first.
    _pg_native()


def _register_when_loaded(_module) -> None:
    try:
        register()
    except Exception as error:  # noqa: BLE001 - never break `import torch`
        warnings.warn(f"torch_reccl could not register the reccl backend: {error}", stacklevel=2)


def install() -> None:
    """Registers "reccl" now if torch.distributed is loaded, else as soon as it loads."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "Backend"):
        register()
    else:
        after_import("torch.distributed", _register_when_loaded)


def _cpu_backend(group):
    import torch
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    return pg._get_backend(torch.device("cpu"))


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for reccl groups, which torch refuses
    (it raises for every backend but Gloo: ``get_backend(group) != Backend.GLOO`` in
    torch/distributed/distributed_c10d.py). Same semantics and messages as Gloo's:
    rank 0 waits up to ``timeout`` (a timedelta or seconds; default: the group's
    timeout) for every other rank and raises ``DistBackendError`` naming the first
    rank that did not arrive ("Rank 2 failed to pass monitoredBarrier in 1000 ms"),
    or every such rank with ``wait_all_ranks`` ("Ranks 1, 2 failed to ..."); the
    other ranks raise when rank 0 does not release them within ``timeout``. Runs
    through the group's store, so it works while peers are stuck in a collective.
    A process outside ``group`` returns at once."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group, _rank_not_in_group

    if _rank_not_in_group(group):
        return
    pg = group if group is not None else _get_default_group()
    backend = dist.get_backend(pg)
    if backend != BACKEND_NAME:
        raise ValueError(f"torch_reccl.monitored_barrier: the group's backend is {backend!r}, "
                         f"not 'reccl'; use torch.distributed.monitored_barrier for Gloo groups")
    if not isinstance(wait_all_ranks, bool):
        raise ValueError(f"torch_reccl.monitored_barrier: wait_all_ranks={wait_all_ranks!r} is "
                         "not valid: expected True or False")
    if timeout is None:
        pg.monitored_barrier(wait_all_ranks=wait_all_ranks)
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, datetime.timedelta)):
        raise ValueError(f"torch_reccl.monitored_barrier: timeout={timeout!r} is not valid: "
                         "expected a datetime.timedelta, seconds, or None for the group's timeout")
    seconds = _seconds(timeout)
    if seconds < 0:
        raise ValueError(f"torch_reccl.monitored_barrier: timeout={timeout!r} is negative")
    pg.monitored_barrier(datetime.timedelta(seconds=seconds), wait_all_ranks=wait_all_ranks)


def backend_info(group=None) -> Dict[str, Any]:
    """Engine facts of a reccl group's CPU backend: group (its name), global_ranks
    (the members' ranks in the job; empty for the group the job started with),
    channels, chunk_bytes, window, ops_done, the DCR plan in force (``plan``
    id, ``channels_without_data``) and each rank's share of a large all_reduce
    (``shares``, by rank; None for equal shares: docs/collectives.md)."""
    return _pg_native()._reccl_backend_info(_cpu_backend(group))


def fault_picture(group=None) -> Dict[str, Any]:
    """The fault picture of a reccl group. Its ranks agree on their fault state at
    every CPU collective (no traffic between collectives): the plan the group runs
    or is about to (``plan``: id, start_op, channels_without_data), the most advanced
    rank's ``max_ops_done``, ``agreed_at_op`` (-1: no CPU collective yet), and
    ``degraded_ranks`` with the lowest of them listed in ``degraded`` (ops_done,
    channels_on_backup, nics_down by index into its RECCL_NICS, device_ops_done).
    Ranks whose NICs are down also come from the job's fault board, which processes
    update on change (and every ``RECCL_DCR_PERIOD_MS`` while degraded), so CUDA-only
    groups see them too; reading it costs store requests in proportion to faults."""
    return _pg_native()._reccl_fault_picture(_cpu_backend(group))


install()
