"""One training run of a drill: start the ranks, fire the faults on schedule,
collect steps and events, and stop at the end or at the first sign of trouble.

Every wait is bounded: the ranks must start training within ``start_timeout_s``,
no step may take longer than ``stall_timeout_s``, and the whole run must end
within ``run_timeout_s``; a rank that exits with an error ends the run at once.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from torch_reccl.cli.launch import Job, LaunchError, cuda_net_env, cuda_rank_env
from torch_reccl.drill.schedule import Fault, take_due

TICK_S = 0.05            # how often the driver checks the schedule and the ranks
UPDATE_EVERY_S = 0.25    # how often the live line is redrawn
FINISH_TIMEOUT_S = 60.0  # after the last step: every rank reports "done" and exits
FAILOVER_KINDS = ("failover", "failback", "rebalance", "nic_down", "nic_up", "path_down",
                  "degraded", "recovered")


@dataclasses.dataclass
class Settings:
    steps: Optional[int]
    duration_s: Optional[float]
    batch: int = 64
    width: int = 512
    depth: int = 3
    seed: int = 0
    collective_timeout_s: float = 60.0
    start_timeout_s: float = 180.0
    stall_timeout_s: float = 60.0
    run_timeout_s: float = 1800.0
    backend: str = "reccl"
    device: str = "cpu"

    def trainer_argv(self, commands: bool) -> List[str]:
        argv = [sys.executable, "-m", "torch_reccl.drill.trainer", "--batch", str(self.batch),
                "--width", str(self.width), "--depth", str(self.depth), "--seed", str(self.seed),
                "--timeout", str(self.collective_timeout_s), "--backend", self.backend,
                "--device", self.device]
        argv += ["--steps", str(self.steps)] if self.steps is not None else \
            ["--duration", str(self.duration_s)]
        if commands:
            argv.append("--commands")
        return argv

    def job_env(self) -> Dict[str, str]:
        return cuda_net_env(self.backend) if self.device == "cuda" else {}

    def rank_env(self, placement, rank: int) -> Dict[str, str]:
        if self.device != "cuda":
            return {}
        env = cuda_rank_env(rank, "reccl-drill")
        if self.backend == "reccl":  # NCCL's bootstrap on the never-faulted network; data on the plugin
            env["NCCL_SOCKET_IFNAME"] = placement.control_ifname()
        return env


@dataclasses.dataclass
class AppliedFault:
    fault: Fault
    t: float            # seconds since training began
    step: int           # steps finished when it was applied
    what: str           # what was done, in words


@dataclasses.dataclass
class RunResult:
    label: str
    t0: Optional[float] = None                 # epoch time training began
    steps: List[dict] = dataclasses.field(default_factory=list)    # t relative to t0
    events: List[dict] = dataclasses.field(default_factory=list)   # t relative to t0
    applied: List[AppliedFault] = dataclasses.field(default_factory=list)
    not_applied: List[Fault] = dataclasses.field(default_factory=list)
    done: Dict[int, dict] = dataclasses.field(default_factory=dict)
    error: Optional[str] = None
    failed_t: Optional[float] = None           # when the error ended the run (s since t0)
    world: int = 0

    @property
    def finished(self) -> bool:
        return self.error is None and len(self.done) == self.world and self.world > 0

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e["kind"] == kind)

    @property
    def end_t(self) -> float:
        return self.steps[-1]["t"] if self.steps else 0.0

    def to_json(self) -> dict:
        return {
            "label": self.label, "t0": self.t0, "world": self.world, "error": self.error,
            "failed_t": self.failed_t,
            "finished": self.finished, "steps": self.steps, "events": self.events,
            "applied": [{"fault": a.fault.text, "t": a.t, "step": a.step, "what": a.what}
                        for a in self.applied],
            "not_applied": [f.text for f in self.not_applied],
            "done": {str(rank): d for rank, d in sorted(self.done.items())},
        }


def run_training(label: str, placement, settings: Settings, faults: List[Fault],
                 make_applier: Callable[[Job], object], commands: bool,
                 on_update: Optional[Callable[[RunResult, bool], None]] = None) -> RunResult:
    """Runs the trainer on ``placement`` and applies ``faults`` on schedule.

    ``make_applier(job)`` returns the object whose ``apply(fault) -> str`` makes
    a fault real. ``on_update(result, fault_just_applied)`` is called a few times
    a second and right after each fault, for a live display.
    """
    result = RunResult(label=label, world=placement.ranks)
    pending = list(faults)
    with Job(placement, settings.trainer_argv(commands), env=settings.job_env(),
             per_rank_env=lambda rank: settings.rank_env(placement, rank), commands=commands) as job:
        applier = make_applier(job)
        started = time.monotonic()
        last_step_at = started
        last_update = 0.0
        try:
            while True:
                now = time.monotonic()
                got = job.next_message(TICK_S)
                if got is not None:
                    rank, message = got
                    started_training = result.t0 is None
                    # The stall bound counts from training's start: setting up the
                    # group (start_timeout_s) is not a stall.
                    if _absorb(result, rank, message) or (started_training and result.t0 is not None):
                        last_step_at = time.monotonic()
                    if result.error:
                        break
                if result.t0 is not None and pending:
                    elapsed = time.time() - result.t0
                    for fault in take_due(pending, elapsed, len(result.steps)):
                        t = time.time() - result.t0
                        try:
                            what = applier.apply(fault)
                        except Exception as error:  # FabricError, LaunchError, OSError...
                            raise LaunchError(f"{fault.text}: {error}") from error
                        result.applied.append(AppliedFault(fault, t, len(result.steps), what))
                        if on_update is not None:
                            on_update(result, True)
                if len(result.done) == result.world:
                    break
                now = time.monotonic()
                if on_update is not None and now - last_update >= UPDATE_EVERY_S:
                    last_update = now
                    on_update(result, False)
                failed = job.failed_ranks()
                if failed:
                    _drain(job, result)
                    result.error = (f"rank(s) {failed} failed during training\n{job.logs(failed)}")
                    break
                if job.all_exited():
                    job.wait(5.0)
                    _drain(job, result)
                    if len(result.done) < result.world:
                        result.error = f"the ranks exited without finishing\n{job.logs()}"
                    break
                if result.t0 is None and now - started > settings.start_timeout_s:
                    result.error = (f"the ranks did not start training within "
                                    f"{settings.start_timeout_s:.0f} s\n{job.logs()}")
                    break
                if result.t0 is not None and now - last_step_at > settings.stall_timeout_s:
                    result.error = (f"no training step finished for {settings.stall_timeout_s:.0f} s "
                                    f"(after step {len(result.steps)})\n{job.logs()}")
                    break
                if now - started > settings.run_timeout_s:
                    result.error = f"the run took longer than {settings.run_timeout_s:.0f} s\n{job.logs()}"
                    break
        except LaunchError as error:
            result.error = f"could not apply a fault: {error}\n{job.logs()}"
        if result.error is not None and result.t0 is not None:
            result.failed_t = time.time() - result.t0
        if result.error is None:
            if not job.wait(FINISH_TIMEOUT_S):
                result.error = f"the ranks did not exit within {FINISH_TIMEOUT_S:.0f} s\n{job.logs()}"
            _drain(job, result)
    result.not_applied = pending
    for event in result.events:  # events may arrive before rank 0's "start"
        event["t"] = float(event["time"]) - result.t0 if result.t0 is not None else None
    result.events.sort(key=lambda e: e["time"])
    return result


def _absorb(result: RunResult, rank: int, message: dict) -> bool:
    """Files one message into the result; True when it was a training step."""
    kind = message.get("kind")
    if kind == "start":
        result.t0 = float(message["t0"])
    elif kind == "step":
        step = dict(message)
        step.pop("kind")
        step["t"] = step["t"] - (result.t0 or step["t"])
        result.steps.append(step)
        return True
    elif kind == "event":
        event = {k: v for k, v in message.items() if k not in ("kind", "event")}
        event["kind"] = message["event"]
        result.events.append(event)
    elif kind == "done":
        result.done[rank] = {k: v for k, v in message.items() if k != "kind"}
    elif kind == "command_failed":
        result.error = f"rank {rank} could not apply {message.get('command')}: {message.get('error')}"
    return False


def _drain(job: Job, result: RunResult) -> None:
    while (got := job.next_message(0)) is not None:
        _absorb(result, *got)


def interruptions(result: RunResult, kind: str) -> List[float]:
    """duration_s of every ``kind`` event (detection to traffic resumed)."""
    return [e["duration_s"] for e in result.events if e["kind"] == kind and e.get("duration_s") is not None]


def per_rank(result: RunResult, kind: str) -> Dict[int, int]:
    out: Dict[int, int] = {}
    for e in result.events:
        if e["kind"] == kind:
            out[e["rank"]] = out.get(e["rank"], 0) + 1
    return out


def median(values: List[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return float("nan")
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def step_times(result: RunResult) -> Tuple[float, float, Optional[dict]]:
    """(median, max, slowest step) of the step times after the first step (which
    also makes the connections); (nan, nan, None) with fewer than 2 steps."""
    steps = result.steps[1:]
    if not steps:
        return float("nan"), float("nan"), None
    slowest = max(steps, key=lambda s: s["step_s"])
    return median([s["step_s"] for s in steps]), slowest["step_s"], slowest
