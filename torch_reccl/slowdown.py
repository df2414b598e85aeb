"""The measured slowdown after a failover: throughput before the fault vs once it settles.

Definition (the ``slowdown`` event; docs/user_guide.md repeats it):

- The process's throughput is the sum over its NICs of ``bytes_sent + bytes_received``
  (the per-NIC counters of :func:`torch_reccl.stats`), per second of wall time. The sum
  is over all NICs because a failover moves traffic from one NIC to another.
- A measurement starts at the first ``failover`` event while none is running. The fault
  was detected at ``t0 = event.time - event.duration_s``.
- ``throughput_before``: over ``[t0 - window_s, t0]``.
- Traffic has *settled* ``settle_s`` after the last ``failover``, ``path_down`` or
  ``nic_down`` event of the burst (every connection on a dead NIC fails over within
  a few ms of the others, so one fault is one measurement). ``throughput_after``: over
  ``[settled, settled + window_s]``.
- ``slowdown = throughput_before / throughput_after``: the paper's ``k`` (1.0: no loss;
  2.0: half the throughput) for a job that moves the same bytes every step, because
  bytes/s is then proportional to steps/s. A job whose traffic changes on its own
  (evaluation, checkpointing) in those windows skews it.
- No measurement is reported when the fault heals (a ``failback``) before the after
  window closes, or when there was no traffic before the fault (nothing to compare
  with). ``slowdown`` is None when traffic stopped altogether after the failover.
  A window must be at least half covered by samples to count.

The meter is driven by the event thread: ``observe()`` every event, ``sample()``
about every 0.1 s. It never reads the clock itself, so tests can drive it.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable, Deque, Dict, List, Optional, Tuple

DEFAULT_WINDOW_S = 2.0
DEFAULT_SETTLE_S = 1.0
SAMPLE_INTERVAL_S = 0.1
# A window is measured only when samples cover at least this fraction of it.
MIN_COVERAGE = 0.5
# Burst events: they mean the fault is still spreading over connections.
_BURST_KINDS = ("failover", "path_down", "nic_down")


def total_bytes(nic_stats: Dict[str, dict]) -> int:
    """Bytes sent plus received over every NIC of a ``stats()["nics"]`` dict."""
    return sum(int(n["bytes_sent"]) + int(n["bytes_received"]) for n in nic_stats.values())


class _Measurement:
    def __init__(self, nic: str, detected: float, settled: float):
        self.nic = nic
        self.detected = detected
        self.settled = settled


class SlowdownMeter:
    """Turns a stream of (time, total bytes) samples and events into ``slowdown`` results.

    ``make_event(**fields)`` builds the event object that ``sample()`` returns, so this
    module does not depend on the event type.
    """

    def __init__(self, make_event: Callable[..., object], window_s: float = DEFAULT_WINDOW_S,
                 settle_s: float = DEFAULT_SETTLE_S):
        self._make_event = make_event
        self._lock = threading.Lock()
        self._samples: Deque[Tuple[float, int]] = collections.deque()
        self._measurement: Optional[_Measurement] = None
        self.configure(window_s, settle_s)

    def configure(self, window_s: float, settle_s: float) -> None:
        if not (isinstance(window_s, (int, float)) and 0.2 <= window_s <= 3600):
            raise ValueError(f"window_s={window_s!r} is not valid: expected 0.2..3600 seconds")
        if not (isinstance(settle_s, (int, float)) and 0 <= settle_s <= 3600):
            raise ValueError(f"settle_s={settle_s!r} is not valid: expected 0..3600 seconds")
        with self._lock:
            self.window_s = float(window_s)
            self.settle_s = float(settle_s)

    def observe(self, event) -> None:
        """Feeds one event (anything with kind, time, nic, duration_s)."""
        with self._lock:
            running = self._measurement
            if event.kind == "failover" and running is None:
                detected = event.time - (event.duration_s or 0.0)
                self._measurement = _Measurement(event.nic, detected, event.time + self.settle_s)
            elif event.kind in _BURST_KINDS and running is not None:
                running.settled = max(running.settled, event.time + self.settle_s)
            elif event.kind == "failback" and running is not None:
                self._measurement = None  # healed before we could measure the degraded state

    def sample(self, now: float, nic_bytes: int) -> List[object]:
        """Records the byte total at wall time ``now``; returns finished measurements."""
        with self._lock:
            self._samples.append((now, nic_bytes))
            running = self._measurement
            keep_from = now - self.window_s - self.settle_s - 1.0
            if running is not None:
                keep_from = min(keep_from, running.detected - self.window_s - 1.0)
            while self._samples and self._samples[0][0] < keep_from:
                self._samples.popleft()
            if running is None or now < running.settled + self.window_s:
                return []
            self._measurement = None
            before = self._rate(running.detected - self.window_s, running.detected)
            after = self._rate(running.settled, running.settled + self.window_s)
        if not before or after is None:  # no traffic before, or too few samples
            return []
        ratio = before / after if after > 0 else None
        detail = (f"bytes/s over {self.window_s:g} s before the fault was detected vs "
                  f"{self.window_s:g} s from {self.settle_s:g} s after the last failover")
        if ratio is None:
            detail = "no traffic after the failover; " + detail
        return [self._make_event(
            kind="slowdown", time=now, nic=running.nic, reason="measured", detail=detail,
            slowdown=ratio, window_s=self.window_s,
            throughput_before=before, throughput_after=after)]

    def _rate(self, start: float, end: float) -> Optional[float]:
        inside = [s for s in self._samples if start <= s[0] <= end]
        if len(inside) < 2:
            return None
        (t_a, bytes_a), (t_b, bytes_b) = inside[0], inside[-1]
        if t_b - t_a < MIN_COVERAGE * (end - start):
            return None
        return (bytes_b - bytes_a) / (t_b - t_a)
