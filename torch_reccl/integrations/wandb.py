"""Events into the active Weights & Biases run (never calls ``wandb.init``)::

    wandb.init(project=...)                      # on rank 0, as usual
    torch_reccl.integrations.wandb.attach()      # on every rank (ranks > 0 only forward)

Logged under ``reccl/`` against its own step metric ``reccl/step`` (one step per
event; ``define_metric``), so reccl charts never disturb yours:
``reccl/failovers``, ``reccl/failbacks`` (running totals), ``reccl/interruption_ms``,
``reccl/bytes_replayed``, ``reccl/failback_ms``, ``reccl/nics_down``,
``reccl/slowdown``; and ``reccl/events``, a table with a row per event (logged at
most once a second, and at ``close()``). A :class:`~torch_reccl.policy.FaultPolicy`
given ``loggers=`` adds, at each change of its answer, ``reccl/advice/action`` (0
continue, 1 checkpoint_and_exit, 2 exit_now), ``reccl/advice/faults``,
``reccl/advice/k``, the rule's times, ``reccl/advice/step`` (the training step) and
a row of kind ``advice`` in the table.

By default values are logged with ``commit=False``: they join the row of your next
``run.log`` (or the run's end), so they never advance W&B's own ``_step`` and never
clash with ``run.log(..., step=N)``. Events in the same row keep their latest value;
the table has all of them. ``commit=True`` gives each event a row of its own (only
for runs that never pass ``step=``).

Alerts: one ``run.alert`` per failover, at most one per ``alert_interval_s``
(default 300 s); the next alert counts the failovers it stood for.

Where a framework makes the run later, or on another rank (Megatron-LM: the last
rank), attach first with ``wait_for_run=True`` (events wait until ``wandb.run``
exists) after ``torch_reccl.events.join_job(collector_rank=...)`` names that rank.
Needs ``pip install wandb``.
"""
from __future__ import annotations

import collections
import inspect
import threading
import time
from typing import Deque, Iterable, Optional

from torch_reccl.events import Event
from torch_reccl.integrations._sink import (
    Attachment,
    Totals,
    advice_scalars,
    attach_sink,
    describe,
    describe_advice,
    require,
)

PREFIX = "reccl/"
STEP_METRIC = PREFIX + "step"
TABLE_KEY = PREFIX + "events"
TABLE_COLUMNS = ["time", "rank", "kind", "nic", "peer", "reason", "from_path", "to_path",
                 "duration_ms", "bytes_replayed", "slowdown", "detail"]
TABLE_DELAY_S = 1.0
# Events held while waiting for wandb.init (wait_for_run=True); older ones are dropped.
WAITING_EVENTS = 10000
RUN_POLL_S = 1.0


def _row(event: Event) -> list:
    duration_ms = None if event.duration_s is None else event.duration_s * 1e3
    return [event.time, event.rank, event.kind, event.nic, event.peer, event.reason,
            event.from_path, event.to_path, duration_ms, event.bytes_replayed,
            event.slowdown, event.detail]


class WandbSink:
    def __init__(self, run=None, alert_interval_s: float = 300.0, commit: bool = False,
                 wait_for_run: bool = False):
        wandb = require("wandb", "wandb", "wandb")
        run = run if run is not None else wandb.run
        if run is None and not wait_for_run:
            raise RuntimeError("no active W&B run: call wandb.init() first (on rank 0), pass run=, "
                               "or attach(wait_for_run=True)")
        if alert_interval_s < 0:
            raise ValueError(f"alert_interval_s={alert_interval_s!r} is not valid: expected >= 0 seconds")
        self._wandb = wandb
        self.run = None
        self._commit = commit
        self._alert_interval_s = alert_interval_s
        self._last_alert = None  # monotonic time of the last alert
        self._unreported_failovers = 0
        self._totals = Totals()
        self._lock = threading.Lock()
        self._timer: Optional[threading.Timer] = None
        self._closed = False
        self._incremental = "log_mode" in inspect.signature(wandb.Table.__init__).parameters
        self._rows = []       # rows not yet in a logged table (incremental), or all rows
        self._unlogged = 0    # rows added since the table was last logged
        self._table = self._new_table()
        self._waiting: Deque[Event] = collections.deque(maxlen=WAITING_EVENTS)
        self._run_timer: Optional[threading.Timer] = None
        if run is not None:
            self._bind(run)

    def _bind(self, run) -> None:
        self.run = run
        run.define_metric(STEP_METRIC)
        run.define_metric(PREFIX + "*", step_metric=STEP_METRIC)

    def _new_table(self):
        if self._incremental:
            return self._wandb.Table(columns=TABLE_COLUMNS, log_mode="INCREMENTAL")
        return None  # older wandb: a full table is logged at close()

    def handle(self, event: Event) -> None:
        with self._lock:
            if self._closed:
                return
            self._waiting.append(event)
            self._log_waiting_locked()

    def _log_waiting_locked(self) -> None:
        """Logs the events held so far, once there is a run (wait_for_run: until
        wandb.init() has run, events wait and a timer looks for the run each second)."""
        if self.run is None:
            run = self._wandb.run
            if run is None:
                if self._run_timer is None:
                    self._run_timer = threading.Timer(RUN_POLL_S, self._look_for_run)
                    self._run_timer.daemon = True
                    self._run_timer.start()
                return
            self._bind(run)
        while self._waiting:
            self._log_locked(self._waiting.popleft())

    def _look_for_run(self) -> None:
        with self._lock:
            self._run_timer = None
            if not self._closed:
                self._log_waiting_locked()

    def advice(self, record: dict) -> None:
        """A FaultPolicy answer: ``reccl/advice/*`` scalars, ``reccl/advice/step`` (the
        training step) and a table row of kind "advice"."""
        with self._lock:
            if self._closed:
                return
            self._waiting.append(record)
            self._log_waiting_locked()

    def _log_locked(self, event) -> None:
        if isinstance(event, dict):  # an advice record
            self._totals.steps += 1
            row = {PREFIX + name: value for name, value in advice_scalars(event).items()}
            row[PREFIX + "advice/step"] = event["step"]
            row[STEP_METRIC] = self._totals.steps
            self.run.log(row, commit=self._commit)
            self._add_row([event["time"], None, "advice", "", "", event["action"], -1, -1, None,
                           None, event["k"], describe_advice(event)])
            return
        values = self._totals.update(event)
        row = {PREFIX + name: value for name, value in values.items()}
        row[STEP_METRIC] = self._totals.steps
        self.run.log(row, commit=self._commit)
        self._add_row(_row(event))
        if event.kind == "failover":
            self._maybe_alert(event)

    def _add_row(self, row: list) -> None:
        if self._incremental:
            self._table.add_data(*row)
        else:
            self._rows.append(row)
        self._unlogged += 1
        if self._incremental and self._timer is None:
            self._timer = threading.Timer(TABLE_DELAY_S, self._log_table_later)
            self._timer.daemon = True
            self._timer.start()

    def _log_table_later(self) -> None:
        with self._lock:
            self._timer = None
            if not self._closed:
                self._log_table_locked()

    def _log_table_locked(self) -> None:
        if not self._unlogged:
            return
        if self._incremental:
            self.run.log({TABLE_KEY: self._table, STEP_METRIC: self._totals.steps}, commit=self._commit)
        else:
            table = self._wandb.Table(columns=TABLE_COLUMNS, data=self._rows)
            self.run.log({TABLE_KEY: table, STEP_METRIC: self._totals.steps}, commit=self._commit)
        self._unlogged = 0

    def _maybe_alert(self, event: Event) -> None:
        self._unreported_failovers += 1
        now = time.monotonic()
        if self._last_alert is not None and now - self._last_alert < self._alert_interval_s:
            return
        count, self._unreported_failovers = self._unreported_failovers, 0
        text = describe(event)
        if count > 1:
            text += f" (and {count - 1} more failovers since the last alert)"
        self._last_alert = now
        try:
            self.run.alert(title="reccl: NIC failover", text=text, level=self._wandb.AlertLevel.WARN,
                           wait_duration=self._alert_interval_s or None)
        except Exception as error:  # noqa: BLE001 - an alert must never stop the logging
            print(f"[reccl] W&B alert failed: {error!r}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # timers that fire from now on do nothing
            if self.run is None and self._wandb.run is not None:
                self._bind(self._wandb.run)
            if self.run is not None:
                while self._waiting:
                    self._log_locked(self._waiting.popleft())
                self._log_table_locked()
            elif self._waiting:
                print(f"[reccl] W&B sink closed before any run existed; {len(self._waiting)} "
                      "events were not logged")
            for timer in (self._timer, self._run_timer):
                if timer is not None:
                    timer.cancel()
            self._timer = self._run_timer = None

def attach(run=None, kinds: Optional[Iterable[str]] = None, job_wide: Optional[bool] = None,
           store=None, alert_interval_s: float = 300.0, commit: bool = False,
           wait_for_run: bool = False) -> Attachment:
    """Logs events to ``run`` (default: ``wandb.run``, which must exist on the collecting
    rank, rank 0 unless join_job(collector_rank=...) said otherwise).

    wait_for_run=True: attach before ``wandb.init`` (e.g. when a framework makes the
    run later); events wait (the last 10000) and are logged once ``wandb.run`` exists.
    """
    return attach_sink(lambda: WandbSink(run, alert_interval_s, commit, wait_for_run),
                       kinds, job_wide, store)
