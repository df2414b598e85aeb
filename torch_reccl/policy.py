"""The restart-or-failover rule acting in a running job: one answer per step, the same on every rank.

A training loop holds a :class:`FaultPolicy` and asks it after every step::

    policy = FaultPolicy(checkpoint_interval_steps=500)     # after init_process_group
    for step in range(start, total):
        train_one_step()
        advice = policy.step(step + 1)                       # steps done so far
        if advice.checkpoint or (step + 1) % 500 == 0:
            save_checkpoint(step + 1)
        if advice.exit:
            policy.exit_for_rescheduling(advice)             # exit code 75; torchrun restarts

The collecting rank of the job-wide event view (rank 0 unless ``join_job`` named
another) hears every rank's ``failover``/``failback``/``degraded``/``recovered``/
``stalled`` events (:func:`torch_reccl.on_event` with ``job_wide=True``), times the
steps, and applies :class:`torch_reccl.advisor.Advisor` -- the rule the GPU-hour
simulator (``reccl sim``) applies per fault: eq. 4 chooses between restarting at
once and failing over; after a failover, eq. 2 runs degraded until the next
checkpoint and reloads there, unless the expected repair comes sooner than the
reload would pay. Its answer goes to every rank in one broadcast of a few numbers
per step, so every rank acts at the same step, however late a rank hears of a fault.

Answers: ``continue``; ``checkpoint_and_exit`` (at a checkpoint step: save, then
exit for rescheduling onto healthy hardware); ``exit_now`` (restarting from the last
checkpoint is cheaper than running on degraded: exit without saving).
:meth:`FaultPolicy.exit_for_rescheduling` waits for every rank, prints one line and
exits with :data:`RESCHEDULE_EXIT_CODE` (75, EX_TEMPFAIL: "try again"), which
``torchrun --max-restarts N`` (or a scheduler told to requeue on 75) answers by
starting the job again; the job resumes from its last checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from torch_reccl.advisor import (
    KEEP_GOING,
    RESTART_AT_NEXT_CHECKPOINT,
    RESTART_NOW,
    Advisor,
    Decision,
)

RESCHEDULE_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, try again

CONTINUE = "continue"
CHECKPOINT_AND_EXIT = "checkpoint_and_exit"
EXIT_NOW = "exit_now"
ACTIONS = (CONTINUE, CHECKPOINT_AND_EXIT, EXIT_NOW)

# advised: the rule above. restart: every fault exits at once (restart from the last
# checkpoint, the simulator's "restart"). run_degraded: never exit (fail over and run
# on until the fault heals, the library's behaviour without a policy).
RULES = ("advised", "restart", "run_degraded")

# The events that start or end a fault the job runs around.
FAULT_EVENT_KINDS = ("failover", "failback", "degraded", "recovered", "stalled")

# The paper's case study (docs/simulation.md): T_detect and T_reload half an hour
# each; T_timeout ours, NCCL's IB timeout with its retries.
PAPER_T_DETECT_S = 1800.0
PAPER_T_RELOAD_S = 1800.0
PAPER_T_TIMEOUT_S = 30.0

_ACTION_CODES = {name: code for code, name in enumerate(ACTIONS)}
_DECISION_CODES = {KEEP_GOING: 0, RESTART_AT_NEXT_CHECKPOINT: 1, RESTART_NOW: 2}
_NO_DECISION = -1.0


@dataclass(frozen=True)
class Advice:
    """The policy's answer for one step, identical on every rank."""

    step: int
    action: str                 # CONTINUE, CHECKPOINT_AND_EXIT or EXIT_NOW
    decision: Optional[str]     # the advisor's action while a fault is active, else None
    faults: int                 # faults active on the deciding rank's view of the job
    k: float                    # slowdown used (measured or assumed); 1 while healthy
    k_measured: bool
    t_elapsed_s: float          # work since the last checkpoint, in healthy-step seconds
    threshold_s: float          # eq. 4's threshold (nan while healthy)
    t_restart_s: float          # eq. 1 (nan while healthy)
    t_failover_s: float         # eq. 2 (nan while healthy)
    reason: str                 # the advisor's reason (the deciding rank's; "" elsewhere)

    @property
    def exit(self) -> bool:
        return self.action != CONTINUE

    @property
    def checkpoint(self) -> bool:
        """Save a checkpoint at this step before exiting."""
        return self.action == CHECKPOINT_AND_EXIT

    def to_record(self) -> dict:
        """The answer and its inputs as a dict, kind ``"advice"`` (the integrations log it)."""
        return {"kind": "advice", "time": time.time(), "step": self.step, "action": self.action,
                "decision": self.decision, "faults": self.faults, "k": self.k,
                "k_measured": self.k_measured, "t_elapsed_s": self.t_elapsed_s,
                "threshold_s": self.threshold_s, "t_restart_s": self.t_restart_s,
                "t_failover_s": self.t_failover_s, "reason": self.reason}


class FaultPolicy:
    """Answers each training step with continue / checkpoint and exit / exit now.

    ``checkpoint_interval_steps``: the job saves a checkpoint every this many steps
    (``step % interval == 0``); the policy counts work since the last one and plans
    reloads at them. ``t_detect_s``, ``t_reload_s``, ``t_timeout_s``: the costs of a
    restart (finding the faulty node, rescheduling and loading a checkpoint) and of
    the transport noticing the fault; the paper's values by default.
    ``expected_repair_s``: how long a fault lasts; ``math.inf`` (default) is the
    paper's eq. 2 (the reload at the next checkpoint swaps the hardware out), a
    finite value lets a fault that heals soon be waited out. ``assumed_k``: the
    slowdown until ``min_samples`` degraded steps are measured. ``rule``: one of
    :data:`RULES`. ``group``: the process group the answer is broadcast over (the
    default group; it must hold the collecting rank). ``decide_every``: decide (and
    broadcast) only every this many steps and at checkpoint steps, for steps so
    short that a broadcast per step shows; ``continue`` in between, so an
    ``exit_now`` may come up to that many steps late. ``listen=False``: no event
    callback (feed events with :meth:`observe`). ``loggers``: integration
    attachments (or sinks) whose ``advice(record)`` gets every change of answer.

    Needs torch.distributed initialised when the job has more than one rank.
    """

    def __init__(self, checkpoint_interval_steps: int, *, t_detect_s: float = PAPER_T_DETECT_S,
                 t_reload_s: float = PAPER_T_RELOAD_S, t_timeout_s: float = PAPER_T_TIMEOUT_S,
                 expected_repair_s: float = math.inf, assumed_k: float = 1.03,
                 min_samples: int = 3, window: int = 50, rule: str = "advised", group=None,
                 decide_every: int = 1, listen: bool = True, loggers: Optional[List] = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not isinstance(checkpoint_interval_steps, int) or checkpoint_interval_steps < 1:
            raise ValueError(f"checkpoint_interval_steps must be an int >= 1, "
                             f"got {checkpoint_interval_steps!r}")
        if not isinstance(decide_every, int) or decide_every < 1:
            raise ValueError(f"decide_every must be an int >= 1, got {decide_every!r}")
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; valid: {', '.join(RULES)}")
        if not expected_repair_s > 0:
            raise ValueError(f"expected_repair_s must be > 0 (math.inf: never), "
                             f"got {expected_repair_s}")
        self.interval_steps = checkpoint_interval_steps
        self.decide_every = decide_every
        self.rule = rule
        # The advisor works in seconds; its interval follows the measured healthy step.
        self.advisor = Advisor(checkpoint_interval_s=1.0, t_detect_s=t_detect_s,
                               t_reload_s=t_reload_s, t_timeout_s=t_timeout_s,
                               assumed_k=assumed_k, expected_repair_s=expected_repair_s,
                               window=window, min_samples=min_samples, clock=clock)
        self._clock = clock
        self._group = group
        self._lock = threading.Lock()
        self._pending: list = []          # events not yet applied (applied at the next step)
        self._active: set = set()         # the faults in effect, by who saw them
        self._last_step_at: Optional[float] = None
        self._last: Optional[Advice] = None
        self._reason = ""                 # the latest decision's reason (deciding rank)
        self.loggers = list(loggers or [])
        self._handle = None
        self.rank, self.world, self.decider = _ranks()
        if listen:
            from torch_reccl.events import join_job, on_event

            if self.world > 1:
                self.decider = join_job().collector_rank
            self._handle = on_event(self.observe, kinds=FAULT_EVENT_KINDS, job_wide=self.world > 1)

    # ------------------------------------------------------------ inputs
    def observe(self, event) -> None:
        """One fault event (an :class:`~torch_reccl.events.Event`); the event callback."""
        with self._lock:
            self._pending.append(event)

    def _apply_events(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for event in pending:
            was_active = bool(self._active)
            kind = event.kind
            if kind in ("failover", "stalled"):
                self._active.add(("connection", event.rank, event.connection))
            elif kind == "degraded":
                self._active.add(("nic", event.rank, event.nic))
            elif kind == "failback":
                self._active.discard(("connection", event.rank, event.connection))
            elif kind == "recovered":
                key = (("connection", event.rank, event.connection) if event.connection
                       else ("nic", event.rank, event.nic))
                self._active.discard(key)
            if self._active and not was_active:
                self.advisor.on_failover(t=event.time)
            elif was_active and not self._active:
                self.advisor.on_failback()

    # ------------------------------------------------------------ the answer
    def step(self, step: int, duration_s: Optional[float] = None) -> Advice:
        """The answer after ``step`` steps are done; call it on every rank every step.

        ``duration_s``: how long the step took (default: the time since the previous
        call on the deciding rank).
        """
        deciding = step % self.decide_every == 0 or step % self.interval_steps == 0
        values = None
        if self.rank == self.decider:
            duration_s, now = self._observe_step(duration_s)
            if deciding:
                values = self._decide(step, duration_s, now)
        if not deciding:  # the same on every rank: nothing is exchanged
            if self._last is None:
                return self._advice(step, _healthy_values(0))
            return dataclasses.replace(self._last, step=step, action=CONTINUE)
        values = self._share(values)
        advice = self._advice(step, values)
        if self._last is None or _changes(advice) != _changes(self._last):
            self._log(advice)
        self._last = advice
        return advice

    def _observe_step(self, duration_s: Optional[float]) -> tuple:
        """The deciding rank, every step: the step's time and the events so far."""
        now = self._clock()
        if duration_s is None and self._last_step_at is not None:
            duration_s = now - self._last_step_at
        self._last_step_at = now
        self._apply_events()
        if duration_s is not None and duration_s > 0:
            self.advisor.record_step(duration_s)
        return duration_s, now

    def _decide(self, step: int, duration_s: Optional[float], now: float) -> list:
        self._reason = ""
        if not self._active or self.rule == "run_degraded":
            return _healthy_values(len(self._active))
        if self.rule == "restart":
            self._reason = "rule 'restart': every fault restarts the job from its last checkpoint"
            return [_ACTION_CODES[EXIT_NOW], _DECISION_CODES[RESTART_NOW], len(self._active), 1.0,
                    0.0, 0.0, math.nan, math.nan, math.nan]
        # Work since the last checkpoint in healthy-step seconds; at a checkpoint step
        # the next checkpoint is the one being written now.
        unit = self.advisor.healthy_step_s() or duration_s or 1.0
        self.advisor.checkpoint_interval_s = self.interval_steps * unit
        done = step % self.interval_steps or self.interval_steps
        decision: Decision = self.advisor.decide(done * unit, now=now)
        self._reason = decision.reason
        action = CONTINUE
        if decision.action == RESTART_NOW:
            action = EXIT_NOW
        elif decision.action == RESTART_AT_NEXT_CHECKPOINT and step % self.interval_steps == 0:
            action = CHECKPOINT_AND_EXIT
        return [_ACTION_CODES[action], _DECISION_CODES[decision.action], len(self._active),
                decision.k, float(decision.k_measured), decision.t_elapsed_s, decision.threshold_s,
                decision.t_restart_s, decision.t_failover_s]

    def _share(self, values: Optional[list]) -> list:
        """The deciding rank's numbers, on every rank (one broadcast)."""
        if self.world == 1:
            return values
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values if values is not None else [0.0] * 9, dtype=torch.float64)
        dist.broadcast(tensor, src=self.decider, group=self._group)
        return tensor.tolist()

    def _advice(self, step: int, values: list) -> Advice:
        action, decision, faults, k, k_measured, elapsed, threshold, t_restart, t_failover = values
        decision_name = None
        if decision != _NO_DECISION:
            decision_name = next(n for n, c in _DECISION_CODES.items() if c == int(decision))
        return Advice(step=step, action=ACTIONS[int(action)], decision=decision_name,
                      faults=int(faults), k=k, k_measured=bool(k_measured), t_elapsed_s=elapsed,
                      threshold_s=threshold, t_restart_s=t_restart, t_failover_s=t_failover,
                      reason=self._reason if self.rank == self.decider else "")

    def _log(self, advice: Advice) -> None:
        if not self.loggers:
            return
        record = advice.to_record()
        record.update(rule=self.rule, checkpoint_interval_steps=self.interval_steps,
                      t_detect_s=self.advisor.t_detect_s, t_reload_s=self.advisor.t_reload_s,
                      t_timeout_s=self.advisor.t_timeout_s,
                      expected_repair_s=self.advisor.expected_repair_s)
        for logger in self.loggers:
            log_advice(logger, record)

    # ------------------------------------------------------------ acting on it
    def exit_for_rescheduling(self, advice: Advice, barrier_timeout_s: float = 300.0) -> None:
        """Waits (bounded) until every rank is here -- so every rank's checkpoint is
        written -- prints why, and exits with RESCHEDULE_EXIT_CODE."""
        if not advice.exit:
            raise ValueError(f"advice at step {advice.step} is {advice.action!r}: nothing to exit for")
        if self.world > 1:
            try:
                _bounded_barrier(self._group, barrier_timeout_s)
            except Exception as error:  # a rank that cannot reach the others exits all the same
                print(f"[reccl] rank {self.rank}: waiting for the other ranks before exiting "
                      f"failed: {error}", file=sys.stderr)
        print(rescheduling_message(advice, self.rank), file=sys.stderr, flush=True)
        self.close()
        raise SystemExit(RESCHEDULE_EXIT_CODE)

    def close(self) -> None:
        """Stops listening (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def rescheduling_message(advice: Advice, rank: int) -> str:
    """The line a rank prints as it exits for rescheduling."""
    saved = ("checkpoint at this step written" if advice.checkpoint
             else "no checkpoint: resume from the last one")
    return (f"[reccl] rank {rank}: exiting for rescheduling at step {advice.step} "
            f"({advice.action}; {saved}); exit code {RESCHEDULE_EXIT_CODE}: torchrun "
            f"--max-restarts or the scheduler restarts the job, which resumes from its "
            f"checkpoint" + (f". Why: {advice.reason}" if advice.reason else ""))


def log_advice(logger, record: dict) -> None:
    """Hands ``record`` to an integration attachment (its sink) or a sink; ranks whose
    attachment only forwards events have no sink and log nothing."""
    sink = getattr(logger, "sink", logger)
    if sink is not None:
        sink.advice(record)


def _healthy_values(faults: int) -> list:
    return [_ACTION_CODES[CONTINUE], _NO_DECISION, faults, 1.0, 0.0, 0.0, math.nan, math.nan,
            math.nan]


def _changes(advice: Advice) -> tuple:
    """What makes an answer worth logging: a new action, decision, fault count or k source."""
    return advice.action, advice.decision, advice.faults, advice.k_measured


def _bounded_barrier(group, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    from torch_reccl.backend import BACKEND_NAME, monitored_barrier

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = dist.get_backend(group)
    if backend == BACKEND_NAME:
        monitored_barrier(group=group, timeout=timeout)
    elif backend == "gloo":
        dist.monitored_barrier(group=group, timeout=timeout)
    else:  # NCCL: bounded by the group's own timeout
        dist.barrier(group=group)


def _ranks() -> tuple:
    """(rank, world size, deciding rank) of the default group, or a lone process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), 0
    return 0, 1, 0
