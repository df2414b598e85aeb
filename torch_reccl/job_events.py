"""The job-wide event view: every rank's events reach rank 0 over the c10d store.

(Rank 0 is the default collecting rank; ``join_job(collector_rank=...)`` names
another, e.g. the last rank, where Megatron-LM keeps its W&B run. "Rank 0" below
means the collecting rank, "ranks > 0" every other rank.)

A side channel next to training, never in its way: only background threads touch
the store, over their own connection where the store can clone one
(``TCPStore.clone()``), so a slow store never stalls a training thread and the
training thread's store calls never queue behind ours.

Keys (under the store's own prefix, e.g. torchrun's ``default_pg/``)::

    reccl/events/<rank>/<n>          the n-th batch of rank's events (n = 1, 2, ...),
                                     a JSON list of Event dicts; set before counting it
    reccl/events/<rank>/published    store.add counter: batches rank has published
    reccl/events/published           store.add counter: batches of every rank

A rank > 0 publishes (batch, then its counter, then the job counter). Rank 0 polls
the job counter (one ``add(key, 0)`` per poll while nothing happens) and, when it
moved, each rank's counter; it reads the new batches (they exist, since a batch is
set before its counter moves), deletes them and hands their events to the job-wide
callbacks. A rank that dies simply stops publishing: nothing waits for it. When
rank 0 (the store) is gone, publishing fails; the rank warns once and drops batches.
"""
from __future__ import annotations

import datetime
import json
import queue
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

KEY_PREFIX = "reccl/events"
POLL_INTERVAL_S = 0.2
MAX_BATCH_EVENTS = 256
# Publishing waits this long for more events, so a burst goes out as one batch.
BATCH_DELAY_S = 0.05


# Bound on one store call on our own connection (a clone): a store that stops
# answering costs a background thread this long, never a training thread.
STORE_TIMEOUT_S = 30.0


def _own_connection(store):
    """A second connection to the same store where it can make one, else the store
    itself (whose timeout is the caller's, so it is left alone)."""
    clone = getattr(store, "clone", None)
    if clone is not None:
        try:
            connection = clone()
        except Exception:  # noqa: BLE001 - stores without clone() raise here
            return store
        connection.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return connection
    return store


def _default_store():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "job-wide events need torch.distributed initialised (dist.init_process_group), "
            "or torch_reccl.events.join_job(store=..., rank=..., world_size=...)")
    return distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


class _Publisher:
    """On ranks > 0: sends local events to rank 0 in batches, from its own thread."""

    def __init__(self, store, rank: int):
        self._store = store
        self._rank = rank
        self._queue: "queue.Queue" = queue.Queue()
        self._published = 0
        self._idle = threading.Condition()
        self._pending = 0
        self.failed_batches = 0
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="reccl-events-publish", daemon=True)
        self._thread.start()

    def put(self, event) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(event)

    def flush(self, timeout: float) -> bool:
        """Waits until every event put so far is published (or dropped); True if so."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + BATCH_DELAY_S
            while len(batch) < MAX_BATCH_EVENTS:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # seen again by the outer loop, after this batch
                    break
                batch.append(item)
            self._publish(batch)
            with self._idle:
                self._pending -= len(batch)
                self._idle.notify_all()

    def _publish(self, batch) -> None:
        payload = json.dumps([event.to_dict() for event in batch])
        number = self._published + 1
        try:
            self._store.set(f"{KEY_PREFIX}/{self._rank}/{number}", payload)
            self._store.add(f"{KEY_PREFIX}/{self._rank}/published", 1)
            self._store.add(f"{KEY_PREFIX}/published", 1)
            self._published = number
        except Exception as error:  # noqa: BLE001 - rank 0 gone: training decides, not us
            self.failed_batches += 1
            if not self._warned:
                self._warned = True
                print(f"[reccl] rank {self._rank}: cannot publish events to rank 0 "
                      f"({error}); dropping them", file=sys.stderr)


class _Collector:
    """On rank 0: polls every rank's batches and delivers their events."""

    def __init__(self, store, sources: List[int], deliver: Callable[[List[dict]], None],
                 poll_interval_s: float):
        self._store = store
        self._deliver = deliver
        self._poll_interval_s = poll_interval_s
        self._job_total = 0
        self._read: Dict[int, int] = {rank: 0 for rank in sources}
        self._lock = threading.Lock()  # one poll at a time (thread and flush)
        self._stop = threading.Event()
        self.errors = 0
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="reccl-events-collect", daemon=True)
        self._thread.start()

    def poll(self) -> int:
        """Reads and delivers every batch published so far; returns events delivered."""
        with self._lock:
            try:
                return self._poll_locked()
            except Exception as error:  # noqa: BLE001 - store gone at shutdown
                self.errors += 1
                if not self._warned:
                    self._warned = True
                    print(f"[reccl] rank 0: cannot read other ranks' events ({error})",
                          file=sys.stderr)
                return 0

    def _poll_locked(self) -> int:
        total = self._store.add(f"{KEY_PREFIX}/published", 0)
        if total == self._job_total:
            return 0
        delivered = 0
        for rank in self._read:
            published = self._store.add(f"{KEY_PREFIX}/{rank}/published", 0)
            for number in range(self._read[rank] + 1, published + 1):
                key = f"{KEY_PREFIX}/{rank}/{number}"
                raw = self._store.get(key)
                self._store.delete_key(key)
                self._read[rank] = number
                events = json.loads(raw)
                self._deliver(events)
                delivered += len(events)
        self._job_total = total
        return delivered

    def close(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            self.poll()


class JobChannel:
    """This process's end of the job-wide view: the collector on ``collector_rank``
    (rank 0 by default), a publisher on every other rank."""

    def __init__(self, store, rank: int, world_size: int,
                 deliver_remote: Callable[[List[dict]], None],
                 poll_interval_s: float = POLL_INTERVAL_S, collector_rank: int = 0):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size={world_size!r} is not valid: expected an int >= 1")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank={rank!r} is not valid: expected 0..{world_size - 1}")
        if not (isinstance(collector_rank, int) and 0 <= collector_rank < world_size):
            raise ValueError(f"collector_rank={collector_rank!r} is not valid: expected 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.collector_rank = collector_rank
        connection = _own_connection(store)
        self._publisher: Optional[_Publisher] = None
        self._collector: Optional[_Collector] = None
        if rank != collector_rank:
            self._publisher = _Publisher(connection, rank)
        elif world_size > 1:
            sources = [r for r in range(world_size) if r != collector_rank]
            self._collector = _Collector(connection, sources, deliver_remote, poll_interval_s)

    @property
    def is_publisher(self) -> bool:
        return self._publisher is not None

    def publish(self, event) -> None:
        if self._publisher is not None:
            self._publisher.put(event)

    def flush(self, timeout: float) -> bool:
        """Publishers: wait until queued events are published. The collector: reads
        what is published now. True unless the wait timed out."""
        if self._publisher is not None:
            return self._publisher.flush(timeout)
        if self._collector is not None:
            self._collector.poll()
        return True

    def stats(self) -> Dict[str, int]:
        if self._publisher is not None:
            return {"failed_batches": self._publisher.failed_batches}
        if self._collector is not None:
            return {"read_errors": self._collector.errors}
        return {}

    def close(self, timeout: float = 2.0) -> None:
        if self._publisher is not None:
            self._publisher.close(timeout)
        if self._collector is not None:
            self._collector.close(timeout)
