"""Failover events: typed, JSON-serialisable, delivered to callbacks on a background thread.

The native core pushes events into a lock-free ring; one daemon thread per process
drains it and calls the registered callbacks, so a slow callback never stalls a
data path (at worst the ring fills and counts drops, see ``stats()``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from typing import Callable, Iterable, List, Optional

from torch_reccl._native import native

EVENT_KINDS = (
    "path_down",
    "path_up",
    "failover",
    "failback",
    "rebalance",
    "nic_down",
    "nic_up",
    "connection_failed",
    "handshake_rejected",
)

DRAIN_INTERVAL_S = 0.02


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    time: float               # seconds since the epoch
    rank: Optional[int]
    nic: str
    peer: str
    reason: str               # "link down", "error", "timeout", "injected", "peer", "healed", ...
    detail: str
    connection: int = 0
    from_path: int = -1       # 0 primary, 1 backup, 2.. last-resort rails
    to_path: int = -1
    duration_s: Optional[float] = None     # failover/failback: detection -> traffic resumed
    bytes_replayed: Optional[int] = None   # failover: bytes re-sent after resync
    group: str = ""                        # rebalance: the process group
    op: Optional[int] = None               # rebalance: the collective the new plan starts at
    plan: Optional[int] = None             # rebalance: the plan's id (0 = every channel)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _current_rank() -> Optional[int]:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


class EventHandle:
    """Returned by :func:`on_event`; ``remove()`` unregisters the callback."""

    def __init__(self, hub: "_Hub", callback, kinds):
        self._hub = hub
        self.callback = callback
        self.kinds = kinds

    def remove(self) -> None:
        self._hub.remove(self)


class _Hub:
    def __init__(self):
        self._lock = threading.Lock()
        self._handles: List[EventHandle] = []
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()

    def add(self, handle: EventHandle) -> None:
        with self._lock:
            self._handles.append(handle)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="reccl-events", daemon=True)
                self._thread.start()

    def remove(self, handle: EventHandle) -> None:
        with self._lock:
            if handle in self._handles:
                self._handles.remove(handle)

    def flush(self) -> None:
        """Delivers everything already in the ring, on the caller's thread."""
        self._deliver(native().drain_events(4096))

    def _deliver(self, raw_events) -> None:
        if not raw_events:
            return
        rank = _current_rank()
        with self._lock:
            handles = list(self._handles)
        for raw in raw_events:
            event = Event(rank=rank, **raw)
            for handle in handles:
                if handle.kinds is None or event.kind in handle.kinds:
                    try:
                        handle.callback(event)
                    except Exception as error:  # a bad callback must not stop delivery
                        print(f"[reccl] event callback {handle.callback!r} raised {error!r}",
                              file=sys.stderr)

    def _run(self) -> None:
        drain = native().drain_events
        while True:
            self._deliver(drain(1024))
            self._wake.wait(DRAIN_INTERVAL_S)


_hub = _Hub()


def on_event(fn: Callable[[Event], None], kinds: Optional[Iterable[str]] = None) -> EventHandle:
    """Calls ``fn(event)`` on a background thread for every event (or only ``kinds``)."""
    if not callable(fn):
        raise TypeError("on_event needs a callable")
    kind_set = None
    if kinds is not None:
        kind_set = frozenset([kinds] if isinstance(kinds, str) else kinds)
        unknown = sorted(kind_set - set(EVENT_KINDS))
        if unknown:
            raise ValueError(f"unknown event kinds {unknown}; valid kinds: {', '.join(EVENT_KINDS)}")
    handle = EventHandle(_hub, fn, kind_set)
    _hub.add(handle)
    return handle


def flush_events() -> None:
    """Delivers pending events now (tests and shutdown paths)."""
    _hub.flush()
