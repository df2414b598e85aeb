"""The job-wide event view: every rank's events reach one collecting rank over the c10d store.

(Rank 0 is the default collecting rank; ``join_job(collector_rank=...)`` names
another, e.g. the last rank, where Megatron-LM keeps its W&B run. "The collector"
below means the collecting rank, "publishers" every other rank.)

A side channel next to training, never in its way: only background threads touch
the store, over their own connections (``store.clone()``; made by those threads, so
not even ``join_job`` waits on the store), and nothing a training thread calls
waits on it (``flush`` and ``close`` wait only as long as their timeout).

Cost: in proportion to the events, not to the number of ranks N, and nothing while
nothing happens. One job-wide log, not a key per rank: a store queue (torch >= 2.6;
every rank must use the same kind of store)::

    reccl/events/q      (under the store's own prefix, e.g. torchrun's ``default_pg/``)
                        queue of JSON items: a batch is a list of Event dicts, each with
                        ``rank`` = the publishing rank; a marker is the collector's own
                        {"reccl": "tick" | "flush" | "stop", "n": ..., "id": ...}

- A publisher pushes each batch (up to MAX_BATCH_EVENTS events that arrived within
  BATCH_DELAY_S of each other) with ONE request, ``queue_push`` (fire and forget:
  no reply to wait for); ``flush`` adds one round trip (``check``), so that the
  store has the batches before the caller goes on. Idle: no request, no thread wakes.
- The collector holds one blocking ``queue_pop`` open on its own connection (on the
  wire a WAIT, answered when an item arrives, then the POP): one pop call per batch,
  whichever rank sent it. A pop would time out after POP_TIMEOUT_S, which costs a
  request and makes torch print a socket warning, so while nothing arrives the
  collector's control thread pushes a "tick" every HEARTBEAT_S (30 s) over a second
  connection: idle, the whole job costs 2 store calls (3 wire requests) per 30 s,
  about 0.07 calls/s, for any N. The tick doubles as liveness: not popped within
  STALL_S, the store is "not answering". ``flush`` and ``close`` push a "flush" or
  "stop" marker: the queue is FIFO, so once the marker comes back every batch pushed
  before it has been delivered. A popped item is gone from the store; nothing
  accumulates while the collector runs (batches pushed after it left stay until the
  store goes, with the job).

Why it does not grow with N: there is one key, whoever publishes; the collector never
asks a rank (or a rank's key) anything, it waits for whatever arrives next; a rank
that dies simply stops pushing. Per batch: 1 request from its publisher, 1 pop call
(2 wire requests) at the collector. Measured (tests/pg/test_job_events.py, a counting
proxy around the collector's store): 0 collector calls and 0 publisher requests in
a 2 s idle window, at N = 2 and N = 6 alike; with a 0.5 s heartbeat, 6 to 8 calls
in 2 s, again for both N. (The per-rank design this replaced polled every 0.2 s and
read N - 1 rank counters on every poll after an event.) ``JobChannel.stats()``
counts ``store_requests`` as store calls (a blocking pop once).

Fallback, for stores without queues (torch < 2.6, the legacy non-libuv TCPStore,
FileStore, Python stores): a job-wide log of keys read with a cursor::

    reccl/events/slots     store.add counter: a publisher reserves slot s ...
    reccl/events/log/<s>   ... and sets the batch there (2 requests per batch)
    reccl/events/read      store.add counter: slots the collector has consumed

The collector polls ``add(slots, 0)`` (one request per poll: every poll_interval_s
while batches flow, backing off to IDLE_POLL_MAX_S, i.e. 0.5 requests/s, when idle),
reads each new slot (check, get, delete: 3 requests per batch; deleted once read) and
skips a slot still empty after GAP_GRACE_S (a publisher that died between reserving
and writing it).

When the store is gone (its host killed, stopped, unreachable) a side logs ONE
warning naming the store and what is lost (publishers: their events, dropped and
counted until it answers again; the collector: the others' events), then retries
quietly with exponential backoff (BACKOFF_MIN_S .. BACKOFF_MAX_S), touching the store
again only once a plain TCP connect to its port succeeds (each failing c10d call
makes torch print a warning with a backtrace, so a dead connection is never reused);
when it answers again, one info line. A call stuck for STALL_S (a stopped host
answers nothing and TCPStore has no read timeout) counts as "not answering": events
are dropped meanwhile, the stuck call finishing or failing ends the outage (checked
by the collector's heartbeat, and on publishers whenever an event is put, a flush
waits, or stats() is read: with nothing to publish nothing is lost, so no warning).
Pushes are fire and forget, so a stopped host's pushes wait in the socket buffers and
arrive when it resumes, and the one batch pushed just as a host dies may be lost
unnoticed (the next call fails). Never ``queue_len`` on a store that may hang: its
torch binding keeps the GIL while it waits, which would freeze the process.
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import queue
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

KEY_PREFIX = "reccl/events"
QUEUE_KEY = f"{KEY_PREFIX}/q"
SLOT_KEY = f"{KEY_PREFIX}/slots"
LOG_KEY = KEY_PREFIX + "/log/{}"
READ_KEY = f"{KEY_PREFIX}/read"

MAX_BATCH_EVENTS = 256
# Publishing waits this long for more events, so a burst goes out as one batch.
BATCH_DELAY_S = 0.05
# Events waiting to be published beyond this are dropped (and counted).
MAX_PENDING_EVENTS = 10000

# Queue mode: an idle collector pushes itself a tick this often, so its pop never
# times out; a tick (or any store call) unanswered for STALL_S means the store is not
# answering. POP_TIMEOUT_S only bounds a pop if ticks stop coming.
HEARTBEAT_S = 30.0
POP_TIMEOUT_S = 120.0
STALL_S = 10.0

# Fallback (keys) mode: the collector's poll period while batches flow, the period it
# backs off to while idle, and how long an empty reserved slot is waited for.
POLL_INTERVAL_S = 0.2
IDLE_POLL_MAX_S = 2.0
GAP_GRACE_S = 60.0

# Retries after a failure: exponential backoff between these bounds.
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
PROBE_TIMEOUT_S = 1.0
# Bound on connecting (our clones) and on a blocking call on our own connections.
STORE_TIMEOUT_S = 30.0


def _default_store():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "job-wide events need torch.distributed initialised (dist.init_process_group), "
            "or torch_reccl.events.join_job(store=..., rank=..., world_size=...)")
    return distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def _dist():
    return sys.modules.get("torch.distributed")


def _innermost(store):
    for _ in range(16):  # PrefixStore(PrefixStore(TCPStore)) as torchrun nests them
        under = getattr(store, "underlying_store", None)
        if under is None:
            break
        store = under
    return store


def _supports_queues(store) -> bool:
    """Whether ``store`` has working queue_push/queue_pop/queue_len, decided from its
    type (no request), so every rank of a job with one kind of store agrees."""
    dist = _dist()
    inner = store
    if dist is not None and isinstance(store, getattr(dist, "PrefixStore", ())):
        inner = _innermost(store)
    if not all(callable(getattr(inner, m, None)) for m in ("queue_push", "queue_pop", "queue_len")):
        return False
    if dist is None or not isinstance(inner, dist.Store):
        return True  # a Python store that offers queues
    if isinstance(inner, dist.TCPStore):
        return bool(getattr(inner, "libuvBackend", False))  # the legacy backend raises
    if isinstance(inner, dist.HashStore):
        return True
    # FileStore and Python subclasses that do not override them inherit Store's, which raise.
    return type(inner).queue_push is not dist.Store.queue_push


def _address(store) -> Optional[Tuple[str, int]]:
    inner = _innermost(store)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if isinstance(host, str) and isinstance(port, int) and port > 0:
        return host, port
    return None


def _describe(store) -> str:
    address = _address(store)
    if address is not None:
        return f"{address[0]}:{address[1]}"
    return type(_innermost(store)).__name__


def _reachable(address: Tuple[str, int]) -> bool:
    """A plain TCP connect to the store's port: tells a host that is back from one that
    is still gone without a c10d call (which would print a backtrace when it fails)."""
    try:
        with socket.create_connection(address, timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _connect(source, timeout_s: float, own_source: bool):
    """A new connection to ``source``'s store where it can make one, else ``source``.
    ``own_source``: ``source`` is one of our (possibly dead) connections, whose connect
    timeout may be shortened first; the caller's store is left alone."""
    clone = getattr(source, "clone", None)
    if clone is None:
        return source
    if own_source:
        try:
            source.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a store without set_timeout keeps its own
            pass
    try:
        connection = clone()
    except NotImplementedError:
        return source
    except RuntimeError as error:
        if "pure virtual" in str(error) or "not implemented" in str(error).lower():
            return source  # a Python store without clone()
        raise
    if _innermost(connection) is not _innermost(source):  # HashStore.clone() is itself
        connection.set_timeout(datetime.timedelta(seconds=timeout_s))
    return connection


def _is_wait_timeout(error: Exception) -> bool:
    dist = _dist()
    if dist is None or not isinstance(error, getattr(dist, "DistStoreError", ())):
        return False
    if isinstance(error, getattr(dist, "QueueEmptyError", ())):
        return False
    return "timeout" in str(error).lower()


def _say(text: str) -> None:
    # One write with its newline: print() writes text and end separately, so two
    # threads' lines could run together on one line.
    sys.stderr.write(f"[reccl] {text}\n")
    sys.stderr.flush()


class _Link:
    """One side's view of the store: up or down, one warning per outage, one info line
    when it answers again, the retry backoff, the counters, the call in flight."""

    def __init__(self, rank: int, store, lost: str):
        self.rank = rank
        self.source = store
        self.where = _describe(store)
        self.address = _address(store)
        self._lost = lost
        self._lock = threading.Lock()
        self.down = False
        self._down_since = 0.0
        self._backoff = BACKOFF_MIN_S
        self._retry_at = 0.0
        self._inflight_since: Optional[float] = None
        self.stalled = False
        self.requests = 0
        self.errors = 0
        self.outages = 0
        self.probes = 0
        self.dropped_events = 0
        self._dropped_in_outage = 0

    # --- counting ---------------------------------------------------------------
    def count(self, requests: int = 1) -> None:
        with self._lock:
            self.requests += requests

    def drop(self, events: int) -> None:
        with self._lock:
            self.dropped_events += events
            self._dropped_in_outage += events

    # --- calls ------------------------------------------------------------------
    def call(self, fn, requests: int = 1, watch: bool = True):
        """Runs one store call on this side's thread; ``watch``: a call that takes
        STALL_S counts as the store not answering (see check_stall)."""
        with self._lock:
            self.requests += requests
            if watch:
                self._inflight_since = time.monotonic()
        try:
            result = fn()
        except BaseException:
            with self._lock:
                self._inflight_since = None
                self.stalled = False
            raise
        with self._lock:
            self._inflight_since = None
            self.stalled = False
        self.answered()
        return result

    def check_stall(self, now: Optional[float] = None) -> bool:
        """True while a watched call has been stuck for STALL_S (then the store is down)."""
        with self._lock:
            since = self._inflight_since
            if since is None:
                return False
            if self.stalled:
                return True
            waited = (time.monotonic() if now is None else now) - since
            if waited < STALL_S:
                return False
            self.stalled = True
        self.not_answering(f"a call has waited {waited:.0f} s for an answer")
        return True

    # --- state ------------------------------------------------------------------
    def not_answering(self, reason: str) -> None:
        self._down(reason, error=False)

    def failed(self, error: Optional[BaseException]) -> None:
        """A call failed (or the port still refuses): down, retry after the next backoff."""
        self._down(None if error is None else _short(error), error=error is not None)

    def _down(self, reason: Optional[str], error: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if error:
                self.errors += 1
            if self.down:
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
                self._retry_at = now + self._backoff
                return
            self.down = True
            self.outages += 1
            self._down_since = now
            self._dropped_in_outage = 0
            self._backoff = BACKOFF_MIN_S
            self._retry_at = now + self._backoff
        _say(f"rank {self.rank}: job-wide events: the c10d store at {self.where} is not answering"
             f" ({reason or 'connection refused'}); {self._lost} until it answers again. Retrying "
             f"quietly (backoff up to {BACKOFF_MAX_S:g} s); no further warnings for this outage.")

    def answered(self) -> None:
        with self._lock:
            if not self.down or self.stalled:
                return
            self.down = False
            down_s = time.monotonic() - self._down_since
            dropped = self._dropped_in_outage
            self._backoff = BACKOFF_MIN_S
        _say(f"rank {self.rank}: job-wide events: the c10d store at {self.where} answers again "
             f"after {down_s:.1f} s ({dropped} events dropped meanwhile)")

    def retry_in(self) -> float:
        """0 when a call may be tried now, else the seconds left of the backoff."""
        with self._lock:
            if not self.down:
                return 0.0
            return max(0.0, self._retry_at - time.monotonic())

    def reconnect(self, previous, timeout_s: float):
        """A fresh connection (cloned from ``previous``, our last one, else from the
        caller's store), or None: down, try again after retry_in(). Once down, the store
        is touched again only after its port accepts a plain TCP connect."""
        source = self.source if previous is None else previous
        own_source = source is not self.source
        if self.down and self.address is not None:
            with self._lock:
                self.probes += 1
            if not _reachable(self.address):
                self.failed(None)
                return None
        try:
            return self.call(lambda: _connect(source, timeout_s, own_source), watch=False)
        except Exception as error:  # noqa: BLE001 - store gone: counted, warned once
            self.failed(error)
            return None

    def stats(self) -> Dict[str, Any]:
        self.check_stall()
        with self._lock:
            return {"store_requests": self.requests, "store_errors": self.errors,
                    "store_down": int(self.down), "store_outages": self.outages,
                    "store_probes": self.probes, "dropped_events": self.dropped_events}


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:160]}" if text else type(error).__name__


class _Token:
    """A publisher's flush: done once every event put before it is published or dropped."""

    def __init__(self):
        self.done = threading.Event()


_STOP = object()


class _Publisher:
    """On every rank but the collector: sends local events in batches, from its own thread."""

    def __init__(self, store, rank: int, collector_rank: int, queue_mode: bool):
        self.rank = rank
        self._source = store
        self._queue_mode = queue_mode
        self._connection = None
        self._previous = None
        self._link = _Link(rank, store, f"this rank's events do not reach rank {collector_rank} "
                                        f"(dropped, counted in JobChannel.stats())")
        self._queue: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._backlog = 0
        self._unconfirmed = False
        self.batches_published = 0
        self.events_published = 0
        self.failed_batches = 0
        self._thread = threading.Thread(target=self._run, name="reccl-events-publish", daemon=True)
        self._thread.start()

    def put(self, event) -> None:
        """Never waits: queued for the publishing thread, or dropped (and counted) while
        the store is not answering or more than MAX_PENDING_EVENTS wait."""
        if self._link.check_stall():
            self._link.drop(1)
            return
        with self._lock:
            if self._backlog >= MAX_PENDING_EVENTS:
                full = True
            else:
                full = False
                self._backlog += 1
        if full:
            self._link.drop(1)
            return
        self._queue.put(event)

    def flush(self, timeout: float) -> bool:
        """Waits until every event put so far is published (the store has it) or
        dropped; True if so within ``timeout``."""
        deadline = time.monotonic() + timeout
        token = _Token()
        self._queue.put(token)
        while not token.done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            self._link.check_stall()
            if time.monotonic() >= deadline:
                return False
        return True

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> Dict[str, Any]:
        out = self._link.stats()
        out.update(mode="queue" if self._queue_mode else "keys",
                   batches_published=self.batches_published,
                   events_published=self.events_published,
                   failed_batches=self.failed_batches)
        return out

    # --- the publishing thread ------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, _Token):
                self._confirm(item)
                continue
            batch, tail = [item], None
            deadline = time.monotonic() + BATCH_DELAY_S
            while len(batch) < MAX_BATCH_EVENTS:
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is _STOP or isinstance(nxt, _Token):
                    tail = nxt
                    break
                batch.append(nxt)
            with self._lock:
                self._backlog -= len(batch)
            self._send(batch)
            if tail is _STOP:
                return
            if tail is not None:
                self._confirm(tail)

    def _ready(self) -> bool:
        if self._link.retry_in() > 0:
            return False
        if self._connection is None:
            connection = self._link.reconnect(self._previous, STORE_TIMEOUT_S)
            if connection is None:
                return False
            self._connection = self._previous = connection
        return True

    def _send(self, batch) -> None:
        if not self._ready():
            self._dropped(batch)
            return
        payload = json.dumps([dict(event.to_dict(), rank=self.rank) for event in batch])
        connection = self._connection
        try:
            if self._queue_mode:
                self._link.call(lambda: connection.queue_push(QUEUE_KEY, payload))
            else:
                slot = self._link.call(lambda: connection.add(SLOT_KEY, 1))
                self._link.call(lambda: connection.set(LOG_KEY.format(slot), payload))
        except Exception as error:  # noqa: BLE001 - store gone: warned once, counted
            self._connection = None  # a failed c10d connection is never used again
            self._link.failed(error)
            self._dropped(batch)
            return
        self._unconfirmed = True
        self.batches_published += 1
        self.events_published += len(batch)

    def _dropped(self, batch) -> None:
        self.failed_batches += 1
        self._link.drop(len(batch))

    def _confirm(self, token: _Token) -> None:
        """One round trip, so the store has processed every push before flush returns."""
        connection = self._connection
        if self._unconfirmed and connection is not None and not self._link.down:
            try:
                if self._queue_mode:
                    # check, not queue_len: torch's queue_len binding keeps the GIL while
                    # it waits for the answer, so a stopped store would freeze the process.
                    self._link.call(lambda: connection.check([QUEUE_KEY]))
                else:
                    self._link.call(lambda: connection.add(SLOT_KEY, 0))
                self._unconfirmed = False
            except Exception as error:  # noqa: BLE001
                self._connection = None
                self._link.failed(error)
        token.done.set()


def _decode(raw) -> Any:
    """An item from the store, which anyone with the store may have written: ValueError
    for anything that is not JSON in UTF-8, too deeply nested arrays included (json
    raises RecursionError for those, which would end the collecting thread)."""
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("utf-8")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("a job-wide events item nested too deeply") from None


class _QueueCollector:
    """On the collecting rank, with store queues: one blocking pop open on its own
    connection ("reccl-events-collect"); ticks, flush and stop markers pushed over a
    second one ("reccl-events-control")."""

    def __init__(self, store, rank: int, deliver: Callable[[List[dict]], None]):
        self.rank = rank
        self._source = store
        self._deliver = deliver
        self._link = _Link(rank, store, "other ranks' events do not reach this rank's job-wide "
                                        "callbacks (they drop them)")
        self._id = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}:{time.time_ns()}"
        self._cond = threading.Condition()
        self._requests: "collections.deque" = collections.deque()  # (kind, n) to push
        self._next_marker = 0
        self._seen_marker = 0       # the last of our markers popped (FIFO, so increasing)
        self._pop_ready = False     # the collect thread has a connection and pops
        self._last_pop_at = 0.0     # when the pop last returned (or was armed)
        self._tick: Optional[Tuple[int, float]] = None  # outstanding tick (n, pushed at)
        self._stopping = threading.Event()
        self._control_exit = False
        self.batches_collected = 0
        self.events_collected = 0
        self.bad_items = 0
        self.ticks = 0
        self._collect = threading.Thread(target=self._collect_run, name="reccl-events-collect",
                                         daemon=True)
        self._control = threading.Thread(target=self._control_run, name="reccl-events-control",
                                         daemon=True)
        self._collect.start()
        self._control.start()

    # --- API ----------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Delivers every batch the store had when called; False on timeout or while
        the store is not answering."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._link.down:
                return False
            self._next_marker += 1
            marker = self._next_marker
            self._requests.append(("flush", marker))
            self._cond.notify_all()
            while self._seen_marker < marker:
                left = deadline - time.monotonic()
                if left <= 0 or self._link.down or not self._collect.is_alive():
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self, timeout: float) -> None:
        """Delivers what was published before (a "stop" marker ends the pops), bounded."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._next_marker += 1
            self._requests.append(("stop", self._next_marker))
            self._cond.notify_all()
        self._stopping.set()
        self._collect.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._control_exit = True
            self._cond.notify_all()
        self._control.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> Dict[str, Any]:
        out = self._link.stats()
        out.update(mode="queue", batches_collected=self.batches_collected,
                   events_collected=self.events_collected, bad_items=self.bad_items,
                   heartbeats=self.ticks, read_errors=out["store_errors"])
        return out

    # --- the collect thread: pops and delivers ------------------------------------------
    def _collect_run(self) -> None:
        connection, previous = None, None
        while True:
            if connection is None:
                with self._cond:
                    self._pop_ready = False
                    self._cond.notify_all()
                wait = self._link.retry_in()
                if wait > 0:
                    if self._stopping.wait(wait):
                        return
                    continue
                if self._stopping.is_set() and self._link.down:
                    return
                connection = self._link.reconnect(previous, POP_TIMEOUT_S)
                if connection is None:
                    continue
                previous = connection
                with self._cond:
                    self._pop_ready = True
                    self._last_pop_at = time.monotonic()
                    self._cond.notify_all()
            try:
                raw = self._link.call(lambda: connection.queue_pop(QUEUE_KEY), watch=False)
            except Exception as error:  # noqa: BLE001
                if _is_wait_timeout(error):  # no tick came (control side down): re-arm
                    self._link.count(1)      # the CANCEL_WAIT it cost
                    with self._cond:
                        self._last_pop_at = time.monotonic()
                        self._cond.notify_all()
                    continue
                connection = None  # never reused: each failing c10d call prints a backtrace
                self._link.failed(error)
                continue
            if self._handle(raw):
                return

    def _handle(self, raw) -> bool:
        """Delivers one popped item; True when it is our stop marker."""
        try:
            item = _decode(raw)
        except ValueError:
            item = None
        marker = isinstance(item, dict) and item.get("id") == self._id
        stop = marker and item.get("reccl") == "stop"
        with self._cond:
            self._last_pop_at = time.monotonic()
            if marker:
                self._seen_marker = max(self._seen_marker, int(item.get("n", 0)))
            self._cond.notify_all()
        if marker or isinstance(item, dict):
            return stop  # ours, or a marker of an earlier collector on this store
        if not isinstance(item, list):
            self.bad_items += 1
            return False
        try:
            self._deliver(item)
        except Exception as error:  # noqa: BLE001 - a bad batch must not stop collection
            self.bad_items += 1
            _say(f"rank {self.rank}: job-wide events: could not deliver a batch ({_short(error)})")
            return False
        self.batches_collected += 1
        self.events_collected += len(item)
        return False

    # --- the control thread: ticks, flush and stop markers ----------------------------
    def _control_run(self) -> None:
        connection, previous, made_in = None, None, 0
        while True:
            with self._cond:
                job = None
                while job is None:
                    if self._control_exit:
                        return
                    now = time.monotonic()
                    timeout: Optional[float] = None
                    if self._pop_ready and not self._link.down:
                        if self._requests:
                            job = self._requests[0]
                            break
                        if self._tick is not None:
                            n, pushed_at = self._tick
                            if self._last_pop_at >= pushed_at:
                                self._tick = None
                                continue
                            left = pushed_at + STALL_S - now
                            if left <= 0:
                                self._tick = None
                                self._link.not_answering(
                                    f"nothing popped {STALL_S:g} s after a heartbeat")
                                continue
                            timeout = left
                        else:
                            left = self._last_pop_at + HEARTBEAT_S - now
                            if left <= 0:
                                self._next_marker += 1
                                job = ("tick", self._next_marker)
                                break
                            timeout = left
                    self._cond.wait(timeout)
            kind, n = job
            if connection is not None and self._link.outages != made_in:
                connection = None  # an outage since it was made: it may be dead, never reuse it
            if connection is None:
                connection = self._link.reconnect(previous, STORE_TIMEOUT_S)
                if connection is None:
                    continue  # down now; the collect thread's reconnect ends the outage
                previous, made_in = connection, self._link.outages
            payload = json.dumps({"reccl": kind, "n": n, "id": self._id})
            pushed_at = time.monotonic()
            try:
                self._link.call(lambda: connection.queue_push(QUEUE_KEY, payload))
            except Exception as error:  # noqa: BLE001
                connection = None
                self._link.failed(error)
                continue
            with self._cond:
                if kind == "tick":
                    self.ticks += 1
                    self._tick = (n, pushed_at)
                elif self._requests and self._requests[0] == job:
                    self._requests.popleft()
                if kind == "stop":
                    return


class _KeysCollector:
    """On the collecting rank, for stores without queues: polls the slot counter and
    reads the job-wide log with a cursor ("reccl-events-collect")."""

    def __init__(self, store, rank: int, deliver: Callable[[List[dict]], None],
                 poll_interval_s: float):
        self.rank = rank
        self._source = store
        self._deliver = deliver
        self._poll_interval_s = max(0.001, float(poll_interval_s))
        self._link = _Link(rank, store, "other ranks' events do not reach this rank's job-wide "
                                        "callbacks (they drop them)")
        self._cond = threading.Condition()
        self._poke = False
        self._stopping = False
        self._rounds_started = 0
        self._rounds_done = 0
        self._cursor: Optional[int] = None
        self._gap_since: Optional[float] = None
        self.batches_collected = 0
        self.events_collected = 0
        self.bad_items = 0
        self.skipped_slots = 0
        self._thread = threading.Thread(target=self._run, name="reccl-events-collect", daemon=True)
        self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Runs a read round that starts after this call; True once it completed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._rounds_started + 1
            self._poke = True
            self._cond.notify_all()
            while self._rounds_done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    self._link.check_stall()
                    return False
                self._cond.wait(min(left, 0.5))
        return not self._link.down

    def close(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def stats(self) -> Dict[str, Any]:
        out = self._link.stats()
        out.update(mode="keys", batches_collected=self.batches_collected,
                   events_collected=self.events_collected, bad_items=self.bad_items,
                   skipped_slots=self.skipped_slots, read_errors=out["store_errors"])
        return out

    def _run(self) -> None:
        connection, previous = None, None
        interval = self._poll_interval_s
        while True:
            with self._cond:
                if not self._poke and not self._stopping:
                    self._cond.wait(max(interval, self._link.retry_in()))
                stopping = self._stopping
                self._poke = False
                self._rounds_started += 1
            consumed = 0
            if self._link.retry_in() == 0:
                if connection is None:
                    connection = self._link.reconnect(previous, STORE_TIMEOUT_S)
                    previous = connection or previous
                if connection is not None:
                    try:
                        consumed = self._round(connection)
                    except Exception as error:  # noqa: BLE001
                        connection = None
                        self._link.failed(error)
            with self._cond:
                self._rounds_done += 1
                self._cond.notify_all()
            if stopping:
                return
            interval = (self._poll_interval_s if consumed
                        else min(max(interval, self._poll_interval_s) * 2, IDLE_POLL_MAX_S))

    def _round(self, connection) -> int:
        call = self._link.call
        if self._cursor is None:
            self._cursor = int(call(lambda: connection.add(READ_KEY, 0)))
        total = int(call(lambda: connection.add(SLOT_KEY, 0)))
        consumed = 0
        while self._cursor < total:
            key = LOG_KEY.format(self._cursor + 1)
            if call(lambda: connection.check([key])):
                raw = call(lambda: connection.get(key), requests=2)  # WAIT + GET
                call(lambda: connection.delete_key(key))
                self._gap_since = None
                self._deliver_raw(raw)
            else:
                now = time.monotonic()
                if self._gap_since is None:
                    self._gap_since = now
                if now - self._gap_since < GAP_GRACE_S:
                    break  # a publisher between reserving and writing: next round
                self.skipped_slots += 1  # it died in between
                self._gap_since = None
            self._cursor += 1
            consumed += 1
        if consumed:
            call(lambda: connection.add(READ_KEY, consumed))
        return consumed

    def _deliver_raw(self, raw) -> None:
        try:
            item = _decode(raw)
            if not isinstance(item, list):
                raise ValueError("not a list of events")
            self._deliver(item)
        except Exception as error:  # noqa: BLE001
            self.bad_items += 1
            _say(f"rank {self.rank}: job-wide events: could not deliver a batch ({_short(error)})")
            return
        self.batches_collected += 1
        self.events_collected += len(item)


class JobChannel:
    """This process's end of the job-wide view: the collector on ``collector_rank``
    (rank 0 by default), a publisher on every other rank. ``poll_interval_s`` is used
    only by the fallback for stores without queues (see the module docstring)."""

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
        self.mode = "queue" if _supports_queues(store) else "keys"
        self._closed = False
        self._publisher: Optional[_Publisher] = None
        self._collector = None
        if rank != collector_rank:
            self._publisher = _Publisher(store, rank, collector_rank, self.mode == "queue")
        elif world_size > 1:
            if self.mode == "queue":
                self._collector = _QueueCollector(store, rank, deliver_remote)
            else:
                self._collector = _KeysCollector(store, rank, deliver_remote, poll_interval_s)

    @property
    def is_publisher(self) -> bool:
        return self._publisher is not None

    def publish(self, event) -> None:
        """Never waits on the store (the event is queued, or dropped while it is gone)."""
        if self._publisher is not None:
            self._publisher.put(event)

    def flush(self, timeout: float) -> bool:
        """Publishers: wait until queued events are in the store (or dropped). The
        collector: deliver what the store holds now. False if ``timeout`` passed (or,
        on the collector, while the store is not answering)."""
        if self._publisher is not None:
            return self._publisher.flush(timeout)
        if self._collector is not None:
            return self._collector.flush(timeout)
        return True

    def stats(self) -> Dict[str, Any]:
        """Counters of this side: ``store_requests`` (store calls it made; a blocking
        pop counts once), ``store_errors``, ``store_down``, ``store_outages``,
        ``dropped_events``, ``mode``; publishers ``batches_published``,
        ``events_published``, ``failed_batches`` (dropped); the collector
        ``batches_collected``, ``events_collected``, ``read_errors``."""
        if self._publisher is not None:
            return self._publisher.stats()
        if self._collector is not None:
            return self._collector.stats()
        return {}

    def close(self, timeout: float = 2.0) -> None:
        """Publishes (or, on the collector, delivers) what is pending and stops the
        threads; returns within about ``timeout`` even when the store is gone."""
        if self._closed:
            return
        self._closed = True
        if self._publisher is not None:
            self._publisher.close(timeout)
        if self._collector is not None:
            self._collector.close(timeout)
