"""The fault schedule of ``reccl drill``: ``TARGET:ACTION@WHEN[,...]``.

    rail1:down@20s,rail1:up@40s         rail switch 1 dies at 20 s, comes back at 40 s
    h0nic0:flap@step 50                 host 0's NIC 0 flaps from step 50 on
    nic1:blackhole@1500ms,nic1:heal@5s  host 0's NIC 1 drops every packet for 3.5 s
    h0nic1:slow=10%@5s,h0nic1:heal@20s  host 0's NIC 1 runs at 10% of the fabric rate
    h0nic1:lossy=5%@5s                  host 0's NIC 1 drops 5% of its frames each way

TARGET  railR     NIC R of every host (the rail switch R)
        hHnicR    NIC R of host H
        nicR      NIC R of host 0
ACTION  down | up | flap | blackhole | slow=P% | lossy=P% | heal
        (up undoes down; heal undoes every fault on the target; slow keeps P%
        of the fabric rate, lossy drops P% of the frames; P in (0, 100))
WHEN    Ns or Nms (time since the first training step started; N may have
        decimals) or "step N" / "stepN" (when step N has finished)

Times and steps may be mixed; each fault fires on its own trigger. Parsing
needs no topology; :func:`check_topology` then checks host and rail indices
against the hosts and rails of the run.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, List, Optional

ACTIONS = ("down", "up", "flap", "blackhole", "slow", "lossy", "heal")
# actions that take a percent: slow=10%, lossy=5%
PERCENT_ACTIONS = ("slow", "lossy")
# actions that start a fault, and the actions that end each
STARTS = {"down": ("up", "heal"), "blackhole": ("heal",), "flap": ("heal",),
          "slow": ("heal",), "lossy": ("heal",)}

TARGET_RE = re.compile(r"^(?:rail(?P<rail>\d+)|h(?P<host>\d+)nic(?P<hrail>\d+)|nic(?P<nic>\d+))$")
PERCENT_RE = re.compile(r"^(?P<value>\d+(?:\.\d+)?|\.\d+)%$")
SECONDS_RE = re.compile(r"^(?P<value>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>ms|s)$")
STEP_RE = re.compile(r"^step\s*(?P<step>\d+)$")

ACTION_NAMES = ", ".join(f"{a}=P%" if a in PERCENT_ACTIONS else a for a in ACTIONS)
GRAMMAR = ("TARGET:ACTION@WHEN[,...] where TARGET is railR, hHnicR or nicR, ACTION is one of "
           f"{ACTION_NAMES}, and WHEN is a time (20s, 1500ms) or a step (step 40)")


class ScheduleError(ValueError):
    """A fault schedule that cannot be parsed or does not fit the topology."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One scheduled fault action."""

    text: str                   # as the user wrote it, normalised ("rail1:down@20s")
    rail: int
    host: Optional[int]         # None: every host (a rail target)
    action: str
    at_s: Optional[float] = None
    at_step: Optional[int] = None
    percent: Optional[float] = None  # slow: share of the rate kept; lossy: share dropped

    @property
    def target(self) -> str:
        return f"rail{self.rail}" if self.host is None else f"h{self.host}nic{self.rail}"

    @property
    def when(self) -> str:
        return f"step {self.at_step}" if self.at_step is not None else f"{self.at_s:g}s"

    def hosts(self, host_count: int) -> List[int]:
        return list(range(host_count)) if self.host is None else [self.host]

    def due(self, elapsed_s: float, steps_done: int) -> bool:
        if self.at_step is not None:
            return steps_done >= self.at_step
        return elapsed_s >= self.at_s


def take_due(pending: List[Fault], elapsed_s: float, steps_done: int) -> List[Fault]:
    """Removes from ``pending`` and returns, in schedule order, every fault due
    at ``elapsed_s`` seconds and ``steps_done`` finished steps."""
    due = [f for f in pending if f.due(elapsed_s, steps_done)]
    for fault in due:
        pending.remove(fault)
    return due


def parse_schedule(texts) -> List[Fault]:
    """Faults from one schedule string or several (``--fault`` may repeat), in the
    order given. ``"none"`` or an empty string is an empty schedule."""
    if isinstance(texts, str):
        texts = [texts]
    faults: List[Fault] = []
    for text in texts:
        if text is None or text.strip().lower() in ("", "none"):
            continue
        for item in text.split(","):
            faults.append(parse_fault(item))
    return faults


def parse_fault(item: str) -> Fault:
    raw = item
    item = item.strip().lower()
    if not item:
        raise ScheduleError(f"empty item in the fault schedule (a stray comma?); expected {GRAMMAR}")
    head, at, when = item.partition("@")
    if not at:
        raise ScheduleError(f"fault {raw.strip()!r} has no '@WHEN' (e.g. rail1:down@20s); expected {GRAMMAR}")
    target, colon, action = head.partition(":")
    if not colon:
        raise ScheduleError(f"fault {raw.strip()!r} has no ':ACTION' (e.g. rail1:down@20s); "
                            f"expected {GRAMMAR}")
    match = TARGET_RE.match(target.strip())
    if not match:
        raise ScheduleError(f"fault {raw.strip()!r}: unknown target {target.strip()!r}; valid targets: "
                            "railR (NIC R of every host), hHnicR (NIC R of host H), nicR (NIC R of host 0)")
    if match.group("rail") is not None:
        rail, host = int(match.group("rail")), None
    elif match.group("hrail") is not None:
        rail, host = int(match.group("hrail")), int(match.group("host"))
    else:
        rail, host = int(match.group("nic")), 0
    action, eq, value = action.strip().partition("=")
    action = action.strip()
    if action not in ACTIONS:
        raise ScheduleError(f"fault {raw.strip()!r}: unknown action {action!r}; valid actions: "
                            f"{ACTION_NAMES}")
    percent = parse_percent(action, value.strip() if eq else None, raw.strip())
    at_s, at_step = parse_when(when.strip(), raw.strip())
    target_text = f"rail{rail}" if host is None else f"h{host}nic{rail}"
    when_text = f"step {at_step}" if at_step is not None else f"{at_s:g}s"
    action_text = action if percent is None else f"{action}={percent:g}%"
    return Fault(text=f"{target_text}:{action_text}@{when_text}", rail=rail, host=host,
                 action=action, at_s=at_s, at_step=at_step, percent=percent)


def parse_percent(action: str, value: Optional[str], item: str) -> Optional[float]:
    """The P of slow=P% / lossy=P%; None for the actions that take none."""
    meaning = {"slow": "the share of the fabric rate the NIC keeps",
               "lossy": "the share of frames it drops"}
    if action not in PERCENT_ACTIONS:
        if value is not None:
            raise ScheduleError(f"fault {item!r}: {action} takes no value (only "
                                f"{', '.join(f'{a}=P%' for a in PERCENT_ACTIONS)} do)")
        return None
    if value is None:
        raise ScheduleError(f"fault {item!r}: {action} needs a percent, {meaning[action]}: "
                            f"e.g. {action}=10%")
    match = PERCENT_RE.match(value)
    if not match:
        raise ScheduleError(f"fault {item!r}: {value!r} is not a percent; use e.g. {action}=10% "
                            f"(P in (0, 100), {meaning[action]})")
    percent = float(match.group("value"))
    if not 0 < percent < 100:
        raise ScheduleError(f"fault {item!r}: {action}={value} is out of range; P must be in "
                            f"(0, 100) ({meaning[action]})")
    return percent


def parse_when(when: str, item: str):
    """(seconds, None) or (None, step)."""
    step = STEP_RE.match(when)
    if step:
        return None, int(step.group("step"))
    seconds = SECONDS_RE.match(when)
    if seconds:
        value = float(seconds.group("value"))
        return (value / 1000.0 if seconds.group("unit") == "ms" else value), None
    if re.match(r"^\d+(\.\d+)?$", when):
        raise ScheduleError(f"fault {item!r}: time {when!r} needs a unit: {when}s, {when}ms or step {when}")
    raise ScheduleError(f"fault {item!r}: {when!r} is not a time or step; use e.g. 20s, 1500ms or step 40")


def check_topology(faults: Iterable[Fault], hosts: int, rails: int) -> None:
    """Every host and rail index exists in a run of ``hosts`` x ``rails``."""
    for fault in faults:
        if fault.rail >= rails:
            raise ScheduleError(f"fault {fault.text!r}: rail {fault.rail} does not exist; this run has "
                                f"{rails} rails (0..{rails - 1})")
        if fault.host is not None and fault.host >= hosts:
            raise ScheduleError(f"fault {fault.text!r}: host {fault.host} does not exist; this run has "
                                f"{hosts} hosts (0..{hosts - 1})")


def fault_spans(applied, end_s: float, flap_s: Optional[float] = None):
    """(start_s, end_s, label) for each fault that started and (maybe) ended.

    ``applied``: (Fault, t_s) pairs in the order they were applied. A span starts
    at down/blackhole/flap on a target and ends at its up/heal (or ``end_s``);
    a flap also ends by itself after ``flap_s``. A rail-wide heal or up also
    ends the NIC faults on that rail.
    """
    spans = []
    open_spans = {}  # (target, action) -> (start_s, label)
    for fault, t in applied:
        if fault.action in STARTS:
            key = (fault.target, fault.action)
            if key not in open_spans:
                open_spans[key] = (t, f"{fault.target} {fault.action}")
            continue
        for (target, action), (start, label) in list(open_spans.items()):
            same_target = target == fault.target or (
                fault.host is None and target.endswith(f"nic{fault.rail}"))
            if same_target and fault.action in STARTS[action]:
                spans.append((start, t, label))
                del open_spans[(target, action)]
    for start, label in open_spans.values():
        spans.append((start, end_s, label))
    if flap_s is not None:
        spans = [(start, min(end, start + flap_s) if label.endswith(" flap") else end, label)
                 for start, end, label in spans]
    return sorted(spans)
