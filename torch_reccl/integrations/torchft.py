"""reccl under torchft: a process group torchft's ``Manager`` reconfigures on every
quorum, as it does its own ``ProcessGroupGloo``::

    from torch_reccl.integrations.torchft import ProcessGroupReccl
    from torchft import Manager, DistributedDataParallel, Optimizer

    manager = Manager(pg=ProcessGroupReccl(timeout=timedelta(seconds=30)),
                      load_state_dict=..., state_dict=..., min_replica_size=1)

CPU tensors run on the reccl engine, so a lost NIC, rail or link inside a replica
group's traffic is a failover inside the collective, never a failed step: torchft
sees no error and keeps its quorum. What torchft handles is what failover cannot:
a replica's process that dies (its peers' ops fail with an error naming it, the
step is discarded, the next quorum goes on without it, and it heals from a peer
when it comes back). CUDA tensors: torchft's own ``ProcessGroupNCCL``, with
``torch_reccl`` imported first so that NCCL's traffic runs over the reccl NCCL net
plugin (docs/nccl_plugin.md). Needs ``pip install torchft`` (docs/torchft.md).
"""
from __future__ import annotations

import datetime
from typing import Optional

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(f"torch_reccl.integrations.torchft needs the 'torchft' package "
                      f"(pip install torchft, or pip install 'torch_reccl[torchft]'): {error}") from error

from torch_reccl.backend import Options, cpu_process_group


class ProcessGroupReccl(ProcessGroupWrapper):
    """torchft's reconfigurable process group over the ``"reccl"`` backend (CPU tensors).

    Every ``configure(store_addr, replica_id, rank, world_size, ...)`` (the Manager
    calls it when the quorum changes) aborts the group of the previous quorum and
    makes a new one under the new store prefix; the new group costs nothing until its
    first op, whose rendezvous is the usual two store requests. ``timeout`` (a
    timedelta or seconds) bounds each op and the rendezvous, and the store client's
    connection; ``options`` are the engine settings of :class:`torch_reccl.backend.Options`
    (the same on every replica).

    ``abort()`` is bounded (the reccl backend's abort: running and queued ops fail at
    once, connections close within their close handshake) and leaves the process
    able to form the next quorum's group; ``shutdown()`` lets queued ops finish (at
    most the timeout, 30 s at most) and releases the group. ``errored()`` is the error
    an ``abort()`` for an error recorded, until the next group is made: an op that
    fails reaches torchft through its Work, as with Gloo.
    """

    def __init__(self, timeout: "datetime.timedelta | float" = datetime.timedelta(seconds=60),
                 options: Optional[Options] = None) -> None:
        if not isinstance(timeout, datetime.timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"ProcessGroupReccl: timeout={timeout!r} is not valid: expected a "
                                 "positive datetime.timedelta or number of seconds")
            timeout = datetime.timedelta(seconds=timeout)
        elif timeout.total_seconds() <= 0:
            raise ValueError(f"ProcessGroupReccl: timeout={timeout!r} is not valid: it must be positive")
        if options is not None and not isinstance(options, Options):
            raise ValueError(f"ProcessGroupReccl: options={options!r} is not valid: expected a "
                             "torch_reccl.backend.Options or None")
        super().__init__(timeout=timeout)
        self._options = options or Options()
        self._errored: Optional[Exception] = None

    def _create_pg(self, store, rank: int, world_size: int):
        self._errored = None
        name = "torchft"
        if self._quorum_id is not None:
            name = f"torchft_quorum_{self._quorum_id}"
            if self._group_rank is not None:
                name += f"_rank_{self._group_rank}"
        return cpu_process_group(store, rank, world_size, self._timeout, name,
                                 options=self._options, global_ranks=self._global_ranks)

    def abort(self, errored: bool = True) -> None:
        if errored:
            self._errored = RuntimeError("the reccl process group was aborted")
        super().abort(errored=errored)

    def shutdown(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()

    def errored(self) -> Optional[Exception]:
        return self._errored

    def getBackendName(self) -> str:
        return "torchft-reccl"
