"""Failover events: typed, JSON-serialisable, delivered to callbacks on a background thread.

The native core pushes events into a lock-free ring; one daemon thread per process
drains it and calls the registered callbacks, so a slow callback never stalls a
data path (at worst the ring fills and counts drops, see ``stats()``). The same
thread samples the per-NIC byte counters for the measured ``slowdown`` after a
failover (torch_reccl/slowdown.py) and hands events to the job-wide channel
(torch_reccl/job_events.py), through which rank 0 sees every rank's events.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Callable, Iterable, List, Optional

from torch_reccl._native import native
from torch_reccl.slowdown import SAMPLE_INTERVAL_S, SlowdownMeter, total_bytes

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
    "degraded",    # a NIC up but far slower than its peers (grey failure): traffic moved off it
    "recovered",   # a degraded NIC back near its peers' goodput, or a stalled connection moving traffic again
    "stalled",     # a connection with no usable path, waiting for one (at its start, then ever more rarely)
    "slowdown",
)

DRAIN_INTERVAL_S = 0.02


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    time: float               # seconds since the epoch
    rank: Optional[int]
    nic: str
    peer: str
    reason: str               # "link down", "error", "timeout", "injected", "peer", "healed", "slow", "measured", ...
    detail: str
    connection: int = 0
    from_path: int = -1       # 0 primary, 1 backup, 2.. last-resort rails
    to_path: int = -1
    duration_s: Optional[float] = None     # failover/failback: detection -> traffic resumed
    bytes_replayed: Optional[int] = None   # failover: bytes re-sent after resync
    group: str = ""                        # rebalance: the process group
    op: Optional[int] = None               # rebalance: the collective the new plan starts at
    plan: Optional[int] = None             # rebalance: the plan's id (0 = every channel)
    # slowdown (see torch_reccl/slowdown.py): throughput_before / throughput_after,
    # both in bytes/s summed over the process's NICs, each over window_s seconds.
    slowdown: Optional[float] = None
    window_s: Optional[float] = None
    throughput_before: Optional[float] = None
    throughput_after: Optional[float] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Event":
        """The inverse of to_dict; ignores fields this version does not know (a newer peer)."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _validate_kinds(kinds: Optional[Iterable[str]]) -> Optional[frozenset]:
    if kinds is None:
        return None
    kind_set = frozenset([kinds] if isinstance(kinds, str) else kinds)
    unknown = sorted(kind_set - set(EVENT_KINDS))
    if unknown:
        raise ValueError(f"unknown event kinds {unknown}; valid kinds: {', '.join(EVENT_KINDS)}")
    return kind_set


def _distributed_rank() -> Optional[int]:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


class EventHandle:
    """Returned by :func:`on_event`; ``remove()`` unregisters the callback."""

    def __init__(self, hub: "_Hub", callback, kinds, job_wide: bool = False):
        self._hub = hub
        self.callback = callback
        self.kinds = kinds
        self.job_wide = job_wide

    def wants(self, event: Event) -> bool:
        return self.kinds is None or event.kind in self.kinds

    def remove(self) -> None:
        self._hub.remove(self)


class _Hub:
    def __init__(self):
        self._lock = threading.Lock()
        self._handles: List[EventHandle] = []
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._delivery = threading.RLock()  # one delivery at a time, in order; a callback may flush
        # Held from draining the ring until the events are delivered and queued for
        # rank 0, so a flush that follows a drain on another thread misses nothing.
        self._drain = threading.RLock()
        self.meter = SlowdownMeter(self._local_event)
        self._next_sample = 0.0
        self.channel = None  # job_events.JobChannel once joined

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

    def rank(self) -> Optional[int]:
        channel = self.channel
        return channel.rank if channel is not None else _distributed_rank()

    def _local_event(self, **fields) -> Event:
        fields.setdefault("peer", "")
        return Event(rank=self.rank(), **fields)

    def flush(self) -> None:
        """Delivers everything already in the ring, on the caller's thread."""
        with self._drain:
            self._deliver_local(native().drain_events(4096))

    def _deliver_local(self, raw_events) -> None:
        if not raw_events:
            return
        rank = self.rank()
        events = [Event(rank=rank, **raw) for raw in raw_events]
        for event in events:
            self.meter.observe(event)
        self._dispatch(events)

    def _dispatch(self, events: List[Event]) -> None:
        """Local events: to local callbacks; job-wide callbacks get them on rank 0 and
        rank 0 gets them from the other ranks, so each event reaches a job-wide callback once."""
        channel = self.channel
        publishing = channel is not None and channel.is_publisher
        with self._lock:
            handles = [h for h in self._handles if not (h.job_wide and publishing)]
        self._call(handles, events)
        if publishing:
            for event in events:
                channel.publish(event)

    def deliver_remote(self, dicts: List[dict]) -> None:
        """Events another rank published (collecting rank only): to job-wide callbacks."""
        events = [Event.from_dict(d) for d in dicts]
        with self._lock:
            handles = [h for h in self._handles if h.job_wide]
        self._call(handles, events)

    def _call(self, handles: List[EventHandle], events: List[Event]) -> None:
        with self._delivery:
            for event in events:
                for handle in handles:
                    if not handle.wants(event):
                        continue
                    try:
                        handle.callback(event)
                    except Exception as error:  # a bad callback must not stop delivery
                        print(f"[reccl] event callback {handle.callback!r} raised {error!r}",
                              file=sys.stderr)

    def _sample(self) -> None:
        now = time.time()
        if now < self._next_sample:
            return
        self._next_sample = now + SAMPLE_INTERVAL_S
        finished = self.meter.sample(now, total_bytes(native().nic_stats()))
        if finished:
            self._dispatch(finished)

    def _run(self) -> None:
        drain = native().drain_events
        while True:
            with self._drain:
                self._deliver_local(drain(1024))
                self._sample()
            self._wake.wait(DRAIN_INTERVAL_S)


_hub = _Hub()


def on_event(fn: Callable[[Event], None], kinds: Optional[Iterable[str]] = None,
             job_wide: bool = False, store=None) -> EventHandle:
    """Calls ``fn(event)`` on a background thread for every event (or only ``kinds``).

    job_wide=True: one callback sees the whole job. Rank 0's callback gets every
    rank's events (``event.rank`` says whose); on other ranks the callback gets none,
    their events go to rank 0 instead (another collecting rank: :func:`join_job`).
    Call it on every rank (as with any distributed setup): a rank that never does
    is not heard from. Needs torch.distributed
    initialised (its default store carries the events) or ``store`` with RANK and
    WORLD_SIZE set, or :func:`join_job` first.
    """
    if not callable(fn):
        raise TypeError("on_event needs a callable")
    kind_set = _validate_kinds(kinds)
    if job_wide and _hub.channel is None:
        join_job(store=store)
    handle = EventHandle(_hub, fn, kind_set, job_wide=bool(job_wide))
    _hub.add(handle)
    return handle


def join_job(store=None, rank: Optional[int] = None, world_size: Optional[int] = None,
             poll_interval_s: Optional[float] = None, collector_rank: int = 0):
    """Joins this process to the job-wide event view (idempotent); returns its channel.

    Defaults: the default process group's store, rank and world size; with an
    explicit ``store``, rank and world size default to RANK and WORLD_SIZE.
    ``collector_rank``: the rank whose job-wide callbacks see the whole job (0 by
    default; e.g. ``world_size - 1`` where a framework logs from the last rank, as
    Megatron-LM does). Every rank must pass the same value, before any
    ``on_event(job_wide=True)`` or integration ``attach``.
    """
    from torch_reccl import job_events

    if _hub.channel is not None:
        return _hub.channel
    if store is None:
        store, default_rank, default_world = job_events._default_store()
    else:
        default_rank = _distributed_rank()
        world = os.environ.get("WORLD_SIZE")
        default_world = int(world) if world is not None and world.isdigit() else None
    rank = default_rank if rank is None else rank
    world_size = default_world if world_size is None else world_size
    if rank is None or world_size is None:
        raise ValueError("join_job with a store needs rank and world_size (or RANK and "
                         "WORLD_SIZE in the environment)")
    interval = job_events.POLL_INTERVAL_S if poll_interval_s is None else poll_interval_s
    _hub.channel = job_events.JobChannel(store, rank, world_size, _hub.deliver_remote, interval,
                                         collector_rank)
    return _hub.channel


def leave_job(timeout: float = 2.0) -> None:
    """Publishes what is pending (bounded by ``timeout``) and stops the job-wide threads."""
    channel, _hub.channel = _hub.channel, None
    if channel is not None:
        channel.close(timeout)


def flush_events(job_wide: bool = False, timeout: float = 5.0) -> bool:
    """Delivers pending events now (tests and shutdown paths).

    job_wide=True also pushes them through the job-wide channel: ranks > 0 wait
    (up to ``timeout``) until their events are published; rank 0 reads what the
    others have published. So at the end of a job: flush on every rank, barrier,
    flush again on rank 0. Returns False when the wait timed out.
    """
    _hub.flush()
    channel = _hub.channel
    if job_wide and channel is not None:
        return channel.flush(timeout)
    return True


def configure_slowdown(window_s: float, settle_s: float) -> None:
    """Sets the windows of the measured slowdown (defaults 2 s and 1 s; see slowdown.py)."""
    _hub.meter.configure(window_s, settle_s)


atexit.register(leave_job, 2.0)
