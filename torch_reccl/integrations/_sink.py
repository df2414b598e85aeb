"""What every integration shares: lazy imports of the tool, attaching a sink to the
event stream (job-wide on rank 0), and the running totals the dashboards plot."""
from __future__ import annotations

import importlib
import sys
import threading
from typing import Callable, Dict, Iterable, Optional

from torch_reccl.events import Event, EventHandle, join_job, on_event


def require(module: str, pip_name: str, integration: str):
    """Imports an optional dependency or says which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"torch_reccl.integrations.{integration} needs the '{pip_name}' package "
            f"(pip install {pip_name}, or pip install 'torch_reccl[integrations]'): {error}"
        ) from error


def _distributed_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


class Attachment:
    """One attached sink. ``close()`` stops delivery, then closes the sink (idempotent)."""

    def __init__(self, handle: EventHandle, sink=None):
        self._handle = handle
        self.sink = sink  # None on ranks > 0 of a job-wide attach: they only forward
        self._closed = False

    @property
    def forwarding_only(self) -> bool:
        return self.sink is None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._handle.remove()
        if self.sink is not None:
            self.sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ignore(_event: Event) -> None:
    return None


def attach_sink(make_sink: Callable[[], object], kinds: Optional[Iterable[str]],
                job_wide: Optional[bool], store=None) -> Attachment:
    """Builds the sink (not on ranks that only forward) and feeds it ``sink.handle(event)``.

    job_wide None: job-wide when torch.distributed is initialised (or a store is given).
    """
    if job_wide is None:
        job_wide = _distributed_initialised() or store is not None
    if job_wide:
        channel = join_job(store=store)
        if channel.is_publisher:
            return Attachment(on_event(_ignore, kinds=kinds, job_wide=True))
    sink = make_sink()
    try:
        handle = on_event(sink.handle, kinds=kinds, job_wide=bool(job_wide))
    except BaseException:
        sink.close()
        raise
    return Attachment(handle, sink)


def describe(event: Event) -> str:
    """One line for humans: what happened, where, and what it cost."""
    who = f"rank {event.rank} " if event.rank is not None else ""
    text = f"{who}{event.kind} on {event.nic}"
    if event.peer:
        text += f" to {event.peer}"
    if event.reason:
        text += f" ({event.reason})"
    if event.kind in ("failover", "failback") and event.from_path >= 0:
        text += f": path {event.from_path} -> {event.to_path}"
    if event.duration_s is not None:
        text += f", traffic interrupted {event.duration_s * 1e3:.1f} ms"
    if event.bytes_replayed:
        text += f", {event.bytes_replayed} bytes replayed"
    if event.kind == "slowdown":
        if event.slowdown is not None:
            text += f": k = {event.slowdown:.3f} (throughput before / after)"
        text += (f" ({_rate(event.throughput_before)} before, {_rate(event.throughput_after)} "
                 f"after, {event.window_s:g} s windows)")
    elif event.detail:
        text += f" - {event.detail}"
    return text


ADVICE_ACTIONS = ("continue", "checkpoint_and_exit", "exit_now")  # torch_reccl.policy.ACTIONS


def advice_scalars(record: dict) -> Dict[str, float]:
    """The numbers of a FaultPolicy answer (torch_reccl.policy.Advice.to_record) that
    dashboards plot, keyed by short names; ``action`` as its index in ADVICE_ACTIONS."""
    values = {"advice/action": float(ADVICE_ACTIONS.index(record["action"])),
              "advice/faults": float(record["faults"]), "advice/k": float(record["k"])}
    for name in ("t_elapsed_s", "threshold_s", "t_restart_s", "t_failover_s"):
        if record.get(name) == record.get(name):  # not nan (no fault: no decision)
            values["advice/" + name] = float(record[name])
    return values


def describe_advice(record: dict) -> str:
    """One line for humans: the answer at a step and why."""
    text = f"step {record['step']}: {record['action']}"
    if record.get("decision"):
        measured = "measured" if record.get("k_measured") else "assumed"
        text += (f" (advisor: {record['decision']}, {record['faults']} fault(s) active, "
                 f"k={record['k']:.3f} {measured})")
    if record.get("reason"):
        text += f" - {record['reason']}"
    return text


def _rate(bytes_per_s: Optional[float]) -> str:
    return "?" if bytes_per_s is None else f"{bytes_per_s / 1e6:.1f} MB/s"


class Totals:
    """Running job totals; ``update(event)`` returns the scalars that event changes,
    keyed by short names ("failovers", "interruption_ms", ...)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.failovers = 0
        self.failbacks = 0
        self.steps = 0
        self._down = set()  # (rank, nic) currently down

    def update(self, event: Event) -> Dict[str, float]:
        with self._lock:
            self.steps += 1
            values: Dict[str, float] = {}
            if event.kind == "failover":
                self.failovers += 1
                values["failovers"] = self.failovers
                if event.duration_s is not None:
                    values["interruption_ms"] = event.duration_s * 1e3
                if event.bytes_replayed is not None:
                    values["bytes_replayed"] = event.bytes_replayed
            elif event.kind == "failback":
                self.failbacks += 1
                values["failbacks"] = self.failbacks
                if event.duration_s is not None:
                    values["failback_ms"] = event.duration_s * 1e3
            elif event.kind in ("nic_down", "nic_up"):
                key = (event.rank, event.nic)
                (self._down.add if event.kind == "nic_down" else self._down.discard)(key)
                values["nics_down"] = len(self._down)
            elif event.kind == "slowdown" and event.slowdown is not None:
                values["slowdown"] = event.slowdown
            return values
