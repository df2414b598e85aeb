"""Events into TensorBoard: scalars and a text log through a SummaryWriter::

    torch_reccl.integrations.tensorboard.attach(log_dir="runs/exp1")   # or writer=your_writer

Scalars (x axis: the event count, wall time: the event's time): ``reccl/failovers``
and ``reccl/failbacks`` (running totals), ``reccl/interruption_ms`` (each failover's
detection-to-resumed time), ``reccl/bytes_replayed``, ``reccl/failback_ms``,
``reccl/nics_down`` and ``reccl/slowdown`` (see the ``slowdown`` event). Text:
``reccl/events``, one line per event. A :class:`~torch_reccl.policy.FaultPolicy`
given ``loggers=`` adds, at each change of its answer and against the training
step, ``reccl/advice/action`` (0 continue, 1 checkpoint_and_exit, 2 exit_now),
``reccl/advice/faults``, ``reccl/advice/k`` and the rule's times
(``reccl/advice/t_elapsed_s``, ``threshold_s``, ``t_restart_s``, ``t_failover_s``),
and the text ``reccl/advice``. Needs ``pip install tensorboard``.
"""
from __future__ import annotations

import threading
from typing import Iterable, Optional

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


class TensorBoardSink:
    def __init__(self, writer=None, log_dir: Optional[str] = None):
        if writer is None:
            require("tensorboard", "tensorboard", "tensorboard")
            summary = require("torch.utils.tensorboard", "tensorboard", "tensorboard")
            writer = summary.SummaryWriter(log_dir=log_dir)
            self._owns_writer = True
        else:
            if log_dir is not None:
                raise ValueError("pass writer or log_dir, not both")
            self._owns_writer = False
        self.writer = writer
        self._totals = Totals()
        self._lock = threading.Lock()

    def handle(self, event: Event) -> None:
        values = self._totals.update(event)
        step = self._totals.steps
        with self._lock:
            for name, value in values.items():
                self.writer.add_scalar(PREFIX + name, value, global_step=step, walltime=event.time)
            self.writer.add_text(PREFIX + "events", describe(event), global_step=step,
                                 walltime=event.time)
            self.writer.flush()  # events are rare; make them visible at once

    def advice(self, record: dict) -> None:
        """A FaultPolicy answer: scalars ``reccl/advice/*`` and a line in
        ``reccl/advice``, against the training step."""
        with self._lock:
            for name, value in advice_scalars(record).items():
                self.writer.add_scalar(PREFIX + name, value, global_step=record["step"],
                                       walltime=record["time"])
            self.writer.add_text(PREFIX + "advice", describe_advice(record),
                                 global_step=record["step"], walltime=record["time"])
            self.writer.flush()

    def close(self) -> None:
        with self._lock:
            if self._owns_writer:
                self.writer.close()
            else:
                self.writer.flush()


def attach(writer=None, log_dir: Optional[str] = None, kinds: Optional[Iterable[str]] = None,
           job_wide: Optional[bool] = None, store=None) -> Attachment:
    """Logs events to ``writer`` (a SummaryWriter) or to a new one in ``log_dir``."""
    return attach_sink(lambda: TensorBoardSink(writer, log_dir), kinds, job_wide, store)
