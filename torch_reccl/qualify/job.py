"""The ranks of one ``reccl qualify`` run and how they agree, over the job's c10d store.

Every exchange is one key per rank (rank 0 gathers) or one key in all (rank 0
publishes): O(N) keys per step, and every wait is bounded. A rank that does not
report in time is named, not waited for. Hosts are told apart by ``RECCL_HOST_ID``
where set (``--local`` sets one per rank), else by hostname, boot id and network
namespace, as the engine tells them apart.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Any, Dict, List, Optional

PREFIX = "reccl-qualify/"


class QualifyError(RuntimeError):
    """A step could not go on: its message says why, naming the rank or host."""


def host_key() -> str:
    """What makes this process's host: RECCL_HOST_ID, else hostname, boot id and netns."""
    given = os.environ.get("RECCL_HOST_ID")
    if given:
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "?"
    return f"{socket.gethostname()}/{boot}/{netns}"


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise QualifyError(f"{name} is {'unset' if value is None else repr(value)}: run under torchrun "
                           f"(torchrun --nnodes N --nproc-per-node G -m torch_reccl.qualify) or with --local N")
    return int(value)


class Job:
    """This rank, the job's size and store; the hosts once :meth:`set_hosts` ran."""

    def __init__(self, store_timeout_s: float):
        import torch.distributed as dist

        self.rank = _env_int("RANK")
        self.world = _env_int("WORLD_SIZE")
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise QualifyError(f"{name} is unset: run under torchrun or with --local N")
        timeout = datetime.timedelta(seconds=store_timeout_s)
        store, rank, world = next(dist.rendezvous("env://", self.rank, self.world, timeout=timeout))
        self.store = store
        self.host_key = host_key()
        self.hosts: List[List[int]] = []   # host index -> its ranks, ascending
        self.host_of: List[int] = []       # rank -> host index

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def set_hosts(self, host_of: List[int]) -> None:
        self.host_of = list(host_of)
        self.hosts = [[] for _ in range(max(host_of) + 1)]
        for rank, host in enumerate(host_of):
            self.hosts[host].append(rank)

    @property
    def host(self) -> int:
        return self.host_of[self.rank]

    @property
    def is_leader(self) -> bool:
        """The lowest rank of its host: the one that speaks for the host."""
        return self.hosts[self.host][0] == self.rank

    # -------------------------------------------------------------- exchanges
    def _wait(self, key: str, seconds: float) -> bool:
        try:
            self.store.wait([PREFIX + key], datetime.timedelta(seconds=max(0.001, seconds)))
            return True
        except Exception:  # DistStoreError / RuntimeError on timeout
            return False

    def gather(self, name: str, value: Any, timeout_s: float) -> Optional[List[Any]]:
        """Rank 0: every rank's ``value`` by rank (None for a rank that did not
        report within ``timeout_s``); other ranks: None."""
        self.store.set(f"{PREFIX}{name}/{self.rank}", json.dumps(value))
        if not self.is_root:
            return None
        deadline = time.monotonic() + timeout_s
        out: List[Any] = []
        for rank in range(self.world):
            key = f"{name}/{rank}"
            out.append(json.loads(self.store.get(PREFIX + key))
                       if self._wait(key, deadline - time.monotonic()) else None)
        return out

    def publish(self, name: str, value: Any = None, timeout_s: float = 60.0) -> Any:
        """Rank 0 gives ``value`` to every rank; others wait for it (QualifyError after
        ``timeout_s``) and return it."""
        if self.is_root:
            self.store.set(PREFIX + name, json.dumps(value))
            return value
        if not self._wait(name, timeout_s):
            raise QualifyError(f"rank 0 did not publish {name!r} within {timeout_s:.0f} s "
                               f"(did it fail? its output says why)")
        return json.loads(self.store.get(PREFIX + name))

    def put(self, key: str, value: Any) -> None:
        self.store.set(PREFIX + key, json.dumps(value))

    def get(self, key: str, timeout_s: float) -> Optional[Any]:
        """The value set under ``key``, or None when it did not appear within ``timeout_s``."""
        if not self._wait(key, timeout_s):
            return None
        return json.loads(self.store.get(PREFIX + key))

    def barrier(self, name: str, timeout_s: float) -> None:
        """Every rank arrives (one counter); QualifyError naming none after ``timeout_s``."""
        arrived = self.store.add(f"{PREFIX}{name}/arrived", 1)
        if arrived == self.world:
            self.store.set(f"{PREFIX}{name}/all", "1")
        if not self._wait(f"{name}/all", timeout_s):
            count = self.store.add(f"{PREFIX}{name}/arrived", 0)
            raise QualifyError(f"only {count} of {self.world} ranks reached {name!r} within {timeout_s:.0f} s")


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def versions() -> Dict[str, Any]:
    """torch_reccl, torch and NCCL versions and the kernel: what a report must name."""
    import platform

    import torch

    import torch_reccl

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a torch built without NCCL
            nccl = None
    return {"torch_reccl": torch_reccl.__version__, "torch": torch.__version__, "nccl": nccl,
            "python": platform.python_version(), "kernel": platform.release()}
