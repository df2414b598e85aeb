"""FaultPolicy: the advisor's rule answering every step of a running job, the same on every rank.

One process first (events fed by hand, step times given): the answers follow
torch_reccl.advisor.Advisor.decide -- the rule the simulator applies -- step by
step. Then real jobs of 3 ranks over the "reccl" backend on loopback NICs, where
one rank (not the deciding one) has its NIC taken down by inject_fault: every rank
gets the same answer at every step and leaves at the same step with exit code 75.
"""
from __future__ import annotations

import json
import math
import time

import pytest

from torch_reccl.advisor import RESTART_AT_NEXT_CHECKPOINT, RESTART_NOW, Advisor
from torch_reccl.events import Event
from torch_reccl.policy import (
    CHECKPOINT_AND_EXIT,
    CONTINUE,
    EXIT_NOW,
    RESCHEDULE_EXIT_CODE,
    FaultPolicy,
)

from conftest import init_rank_groups, reccl_env, report_rank, run_rank_job


def event(kind: str, connection: int = 7, rank: int = 1, nic: str = "eth0", t: float = 0.0):
    return Event(kind=kind, time=t, rank=rank, nic=nic, peer="", reason="injected", detail="",
                 connection=connection)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def run_steps(policy, clock, first, last, seconds):
    answers = []
    for step in range(first, last + 1):
        clock.now += seconds
        answers.append(policy.step(step, duration_s=seconds))
    return answers


def test_healthy_job_always_continues():
    clock = Clock()
    policy = FaultPolicy(10, listen=False, clock=clock)
    answers = run_steps(policy, clock, 1, 30, 1.0)
    assert {a.action for a in answers} == {CONTINUE}
    assert all(a.decision is None and a.faults == 0 for a in answers)


@pytest.mark.parametrize("fault_after, expected_action", [
    (12, EXIT_NOW),               # 3 steps into the interval: below eq. 4's threshold
    (15, CHECKPOINT_AND_EXIT),    # 5 steps in: past it; reload at step 20
])
def test_answers_follow_the_advisor_rule_step_by_step(fault_after, expected_action):
    # k = 1.5 (assumed, then measured), T_detect = 0: eq. 4's threshold is a third
    # of the 10-step interval.
    clock = Clock()
    policy = FaultPolicy(10, t_detect_s=0.0, t_reload_s=2.0, t_timeout_s=0.0, assumed_k=1.5,
                         listen=False, clock=clock)
    run_steps(policy, clock, 1, fault_after, 1.0)
    policy.observe(event("failover", t=clock.now))
    reference = Advisor(checkpoint_interval_s=10.0, t_detect_s=0.0, t_reload_s=2.0,
                        assumed_k=1.5, expected_repair_s=math.inf, clock=clock)
    for _ in range(fault_after):
        reference.record_step(1.0)
    reference.on_failover(t=clock.now)
    answers = []
    for step in range(fault_after + 1, 31):
        clock.now += 1.5
        reference.record_step(1.5)
        advice = policy.step(step, duration_s=1.5)
        answers.append(advice)
        done = step % 10 or 10
        decision = reference.decide(float(done), now=clock.now)
        assert advice.decision == decision.action, step
        assert advice.k == pytest.approx(decision.k) and advice.k_measured == decision.k_measured
        assert advice.threshold_s == pytest.approx(decision.threshold_s)
        assert advice.t_failover_s == pytest.approx(decision.t_failover_s)
        if advice.exit:
            break
    last = answers[-1]
    assert last.action == expected_action
    if expected_action == EXIT_NOW:
        assert last.decision == RESTART_NOW and not last.checkpoint
        assert last.t_elapsed_s <= last.threshold_s
    else:
        assert last.step == 20 and last.checkpoint
        assert last.decision == RESTART_AT_NEXT_CHECKPOINT
        assert all(a.action == CONTINUE for a in answers[:-1])


def test_a_fault_that_heals_before_the_checkpoint_cancels_the_reload():
    clock = Clock()
    policy = FaultPolicy(10, listen=False, clock=clock)
    run_steps(policy, clock, 1, 13, 1.0)
    policy.observe(event("failover", connection=3))
    policy.observe(event("failover", connection=4))
    degraded = run_steps(policy, clock, 14, 16, 1.2)
    assert degraded[-1].faults == 2 and degraded[-1].decision == RESTART_AT_NEXT_CHECKPOINT
    policy.observe(event("failback", connection=3))
    policy.observe(event("failback", connection=4))
    healed = run_steps(policy, clock, 17, 25, 1.0)
    assert {a.action for a in healed} == {CONTINUE} and healed[-1].faults == 0


def test_a_finite_repair_time_is_waited_out():
    # k = 1.2 for at most 20 s more wastes 3.3 s: less than a 100 s reload (and with
    # T_detect = 5 s, eq. 4 never restarts at once).
    clock = Clock()
    policy = FaultPolicy(10, t_detect_s=5.0, t_reload_s=100.0, expected_repair_s=30.0,
                         listen=False, clock=clock)
    run_steps(policy, clock, 1, 15, 1.0)
    policy.observe(event("degraded", connection=0, t=clock.now))
    answers = run_steps(policy, clock, 16, 30, 1.2)
    assert {a.action for a in answers} == {CONTINUE}
    assert answers[-1].decision == "keep_going" and answers[-1].k == pytest.approx(1.2)


@pytest.mark.parametrize("rule, expected", [("restart", EXIT_NOW), ("run_degraded", CONTINUE)])
def test_the_baseline_rules(rule, expected):
    clock = Clock()
    policy = FaultPolicy(10, rule=rule, listen=False, clock=clock)
    run_steps(policy, clock, 1, 15, 1.0)
    policy.observe(event("stalled"))
    assert run_steps(policy, clock, 16, 16, 1.0)[0].action == expected


def test_each_change_of_answer_is_logged_with_its_inputs(tmp_path):
    from torch_reccl.integrations.jsonl import JsonlSink

    sink = JsonlSink(str(tmp_path / "advice.jsonl"))
    clock = Clock()
    policy = FaultPolicy(10, listen=False, clock=clock, loggers=[sink])
    run_steps(policy, clock, 1, 12, 1.0)
    policy.observe(event("failover"))
    run_steps(policy, clock, 13, 20, 1.5)
    sink.close()
    records = [json.loads(line) for line in (tmp_path / "advice.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 13, 15, 20]  # healthy, fault, k measured, exit
    assert [r["action"] for r in records] == [CONTINUE, CONTINUE, CONTINUE, CHECKPOINT_AND_EXIT]
    assert records[-1]["k_measured"] and records[-1]["k"] == pytest.approx(1.5)
    assert records[-1]["t_detect_s"] == 1800.0 and records[-1]["checkpoint_interval_steps"] == 10
    assert "restart at the next checkpoint" in records[-1]["reason"]


def test_decide_every_answers_continue_in_between_and_decides_at_checkpoints():
    clock = Clock()
    policy = FaultPolicy(10, rule="restart", decide_every=4, listen=False, clock=clock)
    run_steps(policy, clock, 1, 13, 1.0)
    policy.observe(event("failover"))
    answers = run_steps(policy, clock, 14, 16, 1.0)
    # decided at 16 (a multiple of 4): the fault heard after step 13 exits there
    assert [(a.step, a.action) for a in answers] == [(14, CONTINUE), (15, CONTINUE), (16, EXIT_NOW)]
    advised = FaultPolicy(10, decide_every=8, listen=False, clock=clock)
    run_steps(advised, clock, 1, 13, 1.0)
    advised.observe(event("failover"))
    answers = run_steps(advised, clock, 14, 20, 1.5)
    assert answers[-1].action == CHECKPOINT_AND_EXIT and answers[-1].step == 20  # a checkpoint step
    assert {a.action for a in answers[:-1]} == {CONTINUE}


@pytest.mark.parametrize("kwargs, message", [
    ({"checkpoint_interval_steps": 0}, "checkpoint_interval_steps"),
    ({"checkpoint_interval_steps": 10, "rule": "sometimes"}, "valid: advised, restart"),
    ({"checkpoint_interval_steps": 10, "expected_repair_s": 0}, "expected_repair_s"),
    ({"checkpoint_interval_steps": 10, "decide_every": 0}, "decide_every"),
])
def test_bad_parameters_name_what_is_valid(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FaultPolicy(listen=False, **kwargs)


# ------------------------------------------------------------------ real ranks

WORLD = 3
FAULTY_RANK = 1  # not the deciding rank (0): it sees the fault first
FAULT_AFTER = 12
STEPS = 60


def policy_rank(rank, port, out_dir, rule, decide_every):
    import os

    os.environ.update(reccl_env())

    def body(result):
        import torch_reccl

        torch, dist, _ = init_rank_groups(rank, port, WORLD)
        # T_detect = 1 s outweighs 10 steps at any slowdown here: eq. 4 never restarts
        policy = FaultPolicy(10, t_detect_s=1.0, t_reload_s=0.1, rule=rule,
                             decide_every=decide_every)
        answers, seen = [], []
        torch_reccl.on_event(lambda e: seen.append((e.kind, time.time())),
                             kinds=["failover", "nic_down"])
        data = torch.full((1 << 16,), float(rank + 1))
        for step in range(1, STEPS + 1):
            if step == FAULT_AFTER + 1 and rank == FAULTY_RANK:
                torch_reccl.inject_fault("lo:127.0.0.1", "down")
            dist.all_reduce(data)
            data.div_(WORLD)
            # a step of work; slower on the faulty rank once its NIC is down (loopback
            # NICs share one link, so the failover itself costs no bandwidth)
            time.sleep(0.05 if rank == FAULTY_RANK and step > FAULT_AFTER else 0.02)
            advice = policy.step(step)
            answers.append([step, advice.action, advice.decision, advice.faults])
            if advice.exit:
                try:
                    policy.exit_for_rescheduling(advice)
                except SystemExit as done:
                    result["exit_code"] = done.code
                break
        result["answers"] = answers
        result["first_fault_seen"] = min((t for _, t in seen), default=None)

    report_rank(out_dir, rank, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rule, action, decide_every", [
    ("advised", CHECKPOINT_AND_EXIT, 1), ("restart", EXIT_NOW, 1), ("restart", EXIT_NOW, 4)])
def test_every_rank_gets_the_same_answer_at_the_same_step(tmp_path, rule, action, decide_every):
    results = run_rank_job(tmp_path, policy_rank, WORLD, (rule, decide_every), job_timeout_s=100)
    answers = [r["answers"] for r in results]
    assert answers[1] == answers[0] and answers[2] == answers[0], answers
    last_step, last_action, _, faults = answers[0][-1]
    assert last_action == action and faults > 0
    assert all(r["exit_code"] == RESCHEDULE_EXIT_CODE for r in results)
    assert last_step > FAULT_AFTER and last_step % decide_every == 0
    if rule == "advised":
        # the first checkpoint step after the deciding rank heard of the fault
        heard = next(step for step, _, _, n in answers[0] if n > 0)
        assert heard > FAULT_AFTER and last_step == -(-heard // 10) * 10, answers[0]
    # the faulty rank heard of its own fault no later than the deciding rank
    assert results[FAULTY_RANK]["first_fault_seen"] <= results[0]["first_fault_seen"] + 0.5
