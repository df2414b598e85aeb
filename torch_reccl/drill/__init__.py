"""``reccl drill``: a training run under a fault schedule (see :mod:`torch_reccl.drill.cli`).

schedule: the TARGET:ACTION@WHEN grammar; trainer: the rank program; faults:
fabric and inject_fault appliers; runner: one run, bounded; plot: the PNG.
"""
from torch_reccl.drill.schedule import Fault, ScheduleError, parse_schedule  # noqa: F401

__all__ = ["Fault", "ScheduleError", "parse_schedule"]
