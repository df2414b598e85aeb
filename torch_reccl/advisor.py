"""Restart or fail over? The decision rule of docs/design.md §10 and an online advisor.

After a last-hop fault a job can restart from its last checkpoint, or fail over and
run slower (by a factor ``k``) until the next checkpoint, where a planned reload swaps
the faulty hardware out. Measured from the fault to that next checkpoint:

    t_restart  = T_timeout + T_detect + T_reload + T_interval
    t_failover = T_timeout + k (T_interval - t_elapsed) + T_reload

so failing over wins once ``t_elapsed > (T_interval (k - 1) - T_detect) / k``.

The rule functions are unit-agnostic and work on floats and on numpy arrays alike:
the GPU-hour simulator (``torch_reccl.sim``) applies them to thousands of runs at once
in hours, the :class:`Advisor` to one running job in seconds.

This module must stay importable without torch or the C++ extension.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

# Decision.action values
RESTART_NOW = "restart_now"
RESTART_AT_NEXT_CHECKPOINT = "restart_at_next_checkpoint"
KEEP_GOING = "keep_going"


def failover_threshold(interval, k, t_detect):
    """Time since the last checkpoint after which failing over beats restarting.

    Negative when failing over always wins (slowdown cheaper than detection).
    """
    return (interval * (k - 1) - t_detect) / k


def restart_cost(interval, t_detect, t_reload, t_timeout):
    """Time from the fault until a restarted job is back at the next checkpoint."""
    return t_timeout + t_detect + t_reload + interval


def failover_cost(t_elapsed, interval, k, t_reload, t_timeout):
    """Time from the fault until a failed-over job reaches the next checkpoint and
    has reloaded there onto healthy hardware."""
    return t_timeout + k * (interval - t_elapsed) + t_reload


def reload_beats_degraded(k, degraded_after_checkpoint, t_reload):
    """At a checkpoint: is a planned reload cheaper than running on degraded?

    Running at slowdown k for a wall time D does the work of D / k, so it wastes
    D (k - 1) / k; the reload wastes t_reload and ends the slowdown at once.
    """
    return degraded_after_checkpoint * (k - 1) / k > t_reload


def _format_duration(seconds: float) -> str:
    magnitude = abs(seconds)
    if magnitude >= 3600:
        return f"{seconds / 3600:.2f} h"
    if magnitude >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


@dataclass(frozen=True)
class Decision:
    """What the advisor recommends, with the numbers behind it (seconds)."""

    action: str  # RESTART_NOW, RESTART_AT_NEXT_CHECKPOINT or KEEP_GOING
    reason: str
    k: float
    k_measured: bool  # False: the advisor's assumed k, not enough steps measured yet
    t_elapsed_s: float
    threshold_s: float
    t_restart_s: float
    t_failover_s: float
    time: float = field(default_factory=time.time)  # wall clock, like other events

    @property
    def failover(self) -> bool:
        """True when failing over beats restarting now."""
        return self.action != RESTART_NOW

    def to_event(self) -> dict:
        """The decision as an event dict, kind ``"advice"``."""
        return {
            "kind": "advice",
            "time": self.time,
            "action": self.action,
            "reason": self.reason,
            "k": self.k,
            "k_measured": self.k_measured,
            "t_elapsed_s": self.t_elapsed_s,
            "threshold_s": self.threshold_s,
            "t_restart_s": self.t_restart_s,
            "t_failover_s": self.t_failover_s,
        }


class Advisor:
    """Tells a running job whether to restart or to keep going after a failover.

    Feed it the duration of every training step (or of a collective that runs once
    per step) with :meth:`record_step`, call :meth:`on_failover` when the library
    fails over and :meth:`on_failback` once every failed path is back. It estimates
    the slowdown k as the ratio of the median step time since the latest failover to
    the median healthy step time, and :meth:`decide` applies the rule.

    ``expected_repair_s`` (how long a fault usually lasts) lets it also weigh a
    planned restart at the next checkpoint against running degraded until the
    repair (the simulator's ``advised`` policy); ``math.inf`` says the fault stays
    until the hardware is swapped, so any slowdown (k > 1) makes the reload at the
    next checkpoint pay: the paper's eq. 2, the simulator's
    ``degrade_until_checkpoint``. Without it, a job past the threshold is told to
    keep going.
    """

    def __init__(
        self,
        checkpoint_interval_s: float,
        t_detect_s: float,
        t_reload_s: float = 0.0,
        t_timeout_s: float = 0.0,
        *,
        assumed_k: float = 1.03,
        expected_repair_s: float | None = None,
        window: int = 50,
        min_samples: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if checkpoint_interval_s <= 0:
            raise ValueError(f"checkpoint_interval_s must be > 0, got {checkpoint_interval_s}")
        if min(t_detect_s, t_reload_s, t_timeout_s) < 0:
            raise ValueError("t_detect_s, t_reload_s and t_timeout_s must be >= 0")
        if assumed_k < 1:
            raise ValueError(f"assumed_k must be >= 1, got {assumed_k}")
        if expected_repair_s is not None and not expected_repair_s >= 0:
            raise ValueError(f"expected_repair_s must be >= 0 (math.inf: until the hardware "
                             f"is swapped), got {expected_repair_s}")
        if min_samples < 1 or window < min_samples:
            raise ValueError("need 1 <= min_samples <= window")
        self.checkpoint_interval_s = checkpoint_interval_s
        self.t_detect_s = t_detect_s
        self.t_reload_s = t_reload_s
        self.t_timeout_s = t_timeout_s
        self.assumed_k = assumed_k
        self.expected_repair_s = expected_repair_s
        self.min_samples = min_samples
        self._clock = clock
        self._healthy_steps: deque[float] = deque(maxlen=window)
        self._degraded_steps: deque[float] = deque(maxlen=window)
        self._failover_at: float | None = None

    @property
    def degraded(self) -> bool:
        return self._failover_at is not None

    def record_step(self, duration_s: float) -> None:
        """Record how long one step (or per-step collective) took."""
        if duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        steps = self._degraded_steps if self.degraded else self._healthy_steps
        steps.append(duration_s)

    def on_failover(self, t: float | None = None) -> None:
        """A failover happened at time t (the advisor's clock, now by default).

        A further failover while degraded starts a fresh measurement: k changes with
        the number of concurrent faults.
        """
        self._failover_at = self._clock() if t is None else t
        self._degraded_steps.clear()

    def on_failback(self) -> None:
        """Every failed path is healthy again: steps count as healthy from now on."""
        self._failover_at = None
        self._degraded_steps.clear()

    def healthy_step_s(self) -> float | None:
        """Median healthy step time: what one step of work costs without a fault."""
        return statistics.median(self._healthy_steps) if self._healthy_steps else None

    def estimate_k(self) -> float | None:
        """Slowdown since the latest failover, or None without enough steps.

        Medians, so the step that absorbed the failover stall does not skew it;
        never below 1, since measurement noise is not a speed-up.
        """
        if (len(self._healthy_steps) < self.min_samples
                or len(self._degraded_steps) < self.min_samples):
            return None
        ratio = statistics.median(self._degraded_steps) / statistics.median(self._healthy_steps)
        return max(1.0, ratio)

    def decide(self, t_elapsed_s: float, now: float | None = None) -> Decision:
        """Advice for a job whose last checkpoint was t_elapsed_s of work ago."""
        if not 0 <= t_elapsed_s <= self.checkpoint_interval_s:
            raise ValueError(
                f"t_elapsed_s must lie in [0, {self.checkpoint_interval_s}], got {t_elapsed_s}")
        measured_k = self.estimate_k()
        k = self.assumed_k if measured_k is None else measured_k
        interval = self.checkpoint_interval_s
        threshold = failover_threshold(interval, k, self.t_detect_s)
        t_restart = restart_cost(interval, self.t_detect_s, self.t_reload_s, self.t_timeout_s)
        t_failover = failover_cost(t_elapsed_s, interval, k, self.t_reload_s, self.t_timeout_s)
        k_text = f"k={k:.3f}" + ("" if measured_k is not None else " (assumed)")

        if t_elapsed_s <= threshold:
            action = RESTART_NOW
            reason = (
                f"restart from the last checkpoint now: back at the next checkpoint in "
                f"{_format_duration(t_restart)} against {_format_duration(t_failover)} "
                f"running on at {k_text}; failing over pays only "
                f"{_format_duration(threshold)} after a checkpoint")
        else:
            action, reason = self._after_failover(
                t_elapsed_s, k, k_text, t_restart - t_failover, now)
        return Decision(
            action=action, reason=reason, k=k, k_measured=measured_k is not None,
            t_elapsed_s=t_elapsed_s, threshold_s=threshold,
            t_restart_s=t_restart, t_failover_s=t_failover)

    def _after_failover(self, t_elapsed_s: float, k: float, k_text: str, saved_s: float,
                        now: float | None) -> tuple[str, str]:
        """Failing over beats restarting now; should the job reload at the next checkpoint?"""
        saved = f"failing over saves {_format_duration(saved_s)} over a restart"
        if self.expected_repair_s is None:
            return KEEP_GOING, f"keep going at {k_text}: {saved}"
        degraded_for = 0.0
        if self._failover_at is not None:
            degraded_for = (self._clock() if now is None else now) - self._failover_at
        to_checkpoint = k * (self.checkpoint_interval_s - t_elapsed_s)
        degraded_after = max(0.0, self.expected_repair_s - degraded_for - to_checkpoint)
        if math.isinf(degraded_after):
            if k > 1:
                return RESTART_AT_NEXT_CHECKPOINT, (
                    f"restart at the next checkpoint: the fault stays until the hardware is "
                    f"swapped, so running on at {k_text} wastes more than the "
                    f"{_format_duration(self.t_reload_s)} reload; until then {saved}")
            return KEEP_GOING, f"keep going at {k_text}: no slowdown to escape; {saved}"
        wasted = degraded_after * (k - 1) / k
        if reload_beats_degraded(k, degraded_after, self.t_reload_s):
            return RESTART_AT_NEXT_CHECKPOINT, (
                f"restart at the next checkpoint is cheaper: reloading costs "
                f"{_format_duration(self.t_reload_s)}, running on at {k_text} until the "
                f"expected repair wastes {_format_duration(wasted)}; until then {saved}")
        return KEEP_GOING, (
            f"keep going at {k_text}: running on until the expected repair wastes "
            f"{_format_duration(wasted)}, less than a {_format_duration(self.t_reload_s)} "
            f"reload; {saved}")
