"""Process-level NIC API over the native core: nics(), stats(), inject_fault()."""
from __future__ import annotations

import importlib
import threading
from typing import Any, Dict, List, Optional

FAULT_KINDS = ("down", "up", "flap", "blackhole")


def native():
    """The compiled extension, imported on first use."""
    importlib.import_module("torch")  # loads libc10/libtorch, which _C links against
    return importlib.import_module("torch_reccl._C")


PLUGIN_LIBRARY = "libnccl-net-reccl.so"


def plugin_path() -> str:
    """Absolute path of the NCCL net plugin library (``ncclNetPlugin_v8..v12``),
    ``libnccl-net-reccl.so``: no torch, no Python, loadable by any NCCL user.

    ``NCCL_NET_PLUGIN=$(python -m torch_reccl --plugin-path)`` gives an unmodified
    NCCL job failover (``NCCL_NET_PLUGIN=reccl`` too, with this directory on
    ``LD_LIBRARY_PATH``). ``torch_reccl._C`` links this same library, so the
    plugin NCCL loads and the Python API share one NIC health table.
    """
    import os

    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), PLUGIN_LIBRARY)
    if not os.path.exists(path):
        raise ImportError(f"{path} is not built; run: pip install --no-build-isolation -e .")
    return path


def testing():
    """The test module ``torch_reccl._testing``: the verbs and CUDA emulations and
    the calls that run the NCCL plugin over them. Never part of what NCCL loads."""
    native()  # registers the types and exceptions the test module builds on
    return importlib.import_module("torch_reccl._testing")


def nics(env: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Local NICs selected by RECCL_NICS, each with its backup NIC and distance cost.

    ``backup_cost`` is -1 where sysfs has no PCI path (veth, loopback): the backup is
    then the next NIC in rail order.
    """
    return native().discover_nics(env)


def stats() -> Dict[str, Any]:
    """Per-NIC bytes, state and failover counts, plus process-wide counters
    (``io_threads``: the I/O threads serving the transports' paths, TCP
    sockets and IB completion channels alike, running now; ``control``: store
    requests of the rendezvous and the fault board, agreements run)."""
    c = native()
    out: Dict[str, Any] = {"nics": c.nic_stats()}
    out.update(c.process_stats())
    if hasattr(c, "_reccl_control_stats"):
        # store requests and per-op agreements of the "reccl" backend's control plane
        out["control"] = c._reccl_control_stats()
    return out


class Flap:
    """A running ``flap`` drill: the NIC goes down and up ``count`` times."""

    def __init__(self, nic: str, period: float, count: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(nic, period, count), name=f"reccl-flap-{nic}", daemon=True
        )
        self._thread.start()

    def _run(self, nic: str, period: float, count: int) -> None:
        c = native()
        try:
            for _ in range(count):
                c.inject_fault(nic, "down")
                if self._stop.wait(period / 2):
                    break
                c.inject_fault(nic, "up")
                if self._stop.wait(period / 2):
                    break
        finally:
            c.inject_fault(nic, "up")

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits for the drill to end; True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def inject_fault(nic: str, kind: str, period: float = 0.2, count: int = 10) -> Optional[Flap]:
    """Process-local fault drill on NIC ``nic`` (a name from :func:`nics`).

    kind: "down" (as if the link died), "up" (heal every injected fault), "flap"
    (down/up ``count`` times, ``period`` seconds each, in the background; returns a
    handle with ``join()`` and ``stop()``) or "blackhole" (traffic silently stops;
    only heartbeats can tell).
    """
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind {kind!r} is not valid; valid kinds: {', '.join(FAULT_KINDS)}")
    if kind == "flap":
        if period <= 0 or count < 1:
            raise ValueError("flap needs period > 0 seconds and count >= 1")
        native().inject_fault(nic, "up")  # validates the NIC name before the thread starts
        return Flap(nic, period, count)
    native().inject_fault(nic, kind)
    return None
