"""Tests of the restart-or-failover rule and the online advisor (docs/design.md §10)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from torch_reccl.advisor import (
    KEEP_GOING,
    RESTART_AT_NEXT_CHECKPOINT,
    RESTART_NOW,
    Advisor,
    failover_cost,
    failover_threshold,
    reload_beats_degraded,
    restart_cost,
)

from conftest import REPO

HOUR = 3600.0


@pytest.mark.parametrize("interval, k, t_detect, expected", [
    (HOUR, 1.5, 0.0, HOUR / 3),           # the paper's example: a third of the interval
    (HOUR, 1.2, 0.1 * HOUR, 300.0),       # (3600 * 0.2 - 360) / 1.2
    (2 * HOUR, 2.0, 0.0, HOUR),           # (7200 * 1 - 0) / 2
    (HOUR, 1.0, 0.0, 0.0),                # no slowdown: failover always wins
    (1.0, 1.03, 0.5, (0.03 - 0.5) / 1.03),  # the case study: negative, failover always wins
])
def test_threshold_matches_hand_computed_cases(interval, k, t_detect, expected):
    assert failover_threshold(interval, k, t_detect) == pytest.approx(expected)


def test_costs_are_equal_at_the_threshold_and_order_around_it():
    interval, k, t_detect, t_reload, t_timeout = HOUR, 1.5, 600.0, 900.0, 30.0
    cut = failover_threshold(interval, k, t_detect)
    t_restart = restart_cost(interval, t_detect, t_reload, t_timeout)
    assert failover_cost(cut, interval, k, t_reload, t_timeout) == pytest.approx(t_restart)
    assert failover_cost(cut - 1, interval, k, t_reload, t_timeout) > t_restart
    assert failover_cost(cut + 1, interval, k, t_reload, t_timeout) < t_restart


def test_rule_functions_accept_numpy_arrays():
    k = np.array([1.0, 1.5, 2.0])
    np.testing.assert_allclose(failover_threshold(3.0, k, 0.0), [0.0, 1.0, 1.5])
    assert reload_beats_degraded(np.array([1.03, 1.5]), 3.0, 0.5).tolist() == [False, True]


def _advisor_with_k(k: float, **kwargs) -> Advisor:
    advisor = Advisor(checkpoint_interval_s=HOUR, t_detect_s=0.0, t_reload_s=600.0, **kwargs)
    for _ in range(10):
        advisor.record_step(2.0)
    advisor.on_failover(t=0.0)
    for _ in range(10):
        advisor.record_step(2.0 * k)
    return advisor


def test_estimate_k_from_steps_before_and_after_a_failover():
    advisor = _advisor_with_k(1.5)
    assert advisor.estimate_k() == pytest.approx(1.5)


def test_estimate_k_needs_samples_ignores_the_stalled_step_and_never_drops_below_one():
    advisor = Advisor(checkpoint_interval_s=HOUR, t_detect_s=0.0, min_samples=3)
    assert advisor.estimate_k() is None
    for _ in range(5):
        advisor.record_step(1.0)
    advisor.on_failover(t=0.0)
    advisor.record_step(31.0)  # the step that waited out the transport timeout
    advisor.record_step(1.2)
    assert advisor.estimate_k() is None
    advisor.record_step(1.2)
    assert advisor.estimate_k() == pytest.approx(1.2)

    faster = Advisor(checkpoint_interval_s=HOUR, t_detect_s=0.0)
    for duration in (1.0, 1.0, 1.0):
        faster.record_step(duration)
    faster.on_failover(t=0.0)
    for duration in (0.9, 0.9, 0.9):
        faster.record_step(duration)
    assert faster.estimate_k() == 1.0


def test_failback_returns_to_healthy_measurement():
    advisor = _advisor_with_k(1.5)
    advisor.on_failback()
    assert not advisor.degraded
    assert advisor.estimate_k() is None
    advisor.record_step(2.0)
    advisor.on_failover(t=5.0)
    for _ in range(3):
        advisor.record_step(2.4)
    assert advisor.estimate_k() == pytest.approx(1.2)


def test_decide_applies_the_rule_with_the_measured_k():
    advisor = _advisor_with_k(1.5)  # threshold: a third of the hour
    early = advisor.decide(HOUR / 3 - 60)
    assert early.action == RESTART_NOW and not early.failover
    assert early.k_measured and early.k == pytest.approx(1.5)
    assert early.threshold_s == pytest.approx(HOUR / 3)
    assert "restart from the last checkpoint now" in early.reason

    late = advisor.decide(HOUR / 3 + 60)
    assert late.action == KEEP_GOING and late.failover
    assert late.t_failover_s < late.t_restart_s
    assert late.reason.startswith("keep going")


@pytest.mark.parametrize("t_elapsed_s, action, t_restart_s, t_failover_s", [
    # k = 1.5, T_detect = 0, T_reload = 600 s: eq. 4 puts the threshold at 1200 s.
    # eq. 1: 0 + 0 + 600 + 3600 = 4200 s; eq. 2 at 1080 s: 1.5 * 2520 + 600 = 4380 s
    (1080.0, RESTART_NOW, 4200.0, 4380.0),
    # eq. 2 at 1296 s: 1.5 * 2304 + 600 = 4056 s, cheaper than restarting
    (1296.0, KEEP_GOING, 4200.0, 4056.0),
])
def test_decide_restarts_exactly_where_eq_4_says_with_eq_1_and_2_costs(
        t_elapsed_s, action, t_restart_s, t_failover_s):
    decision = _advisor_with_k(1.5).decide(t_elapsed_s)
    assert decision.action == action
    assert decision.threshold_s == pytest.approx(1200.0)
    assert decision.t_restart_s == pytest.approx(t_restart_s)
    assert decision.t_failover_s == pytest.approx(t_failover_s)


def test_decide_uses_the_assumed_k_until_measured():
    advisor = Advisor(checkpoint_interval_s=HOUR, t_detect_s=0.5 * HOUR, assumed_k=1.03)
    decision = advisor.decide(0.0)
    assert not decision.k_measured and decision.k == 1.03
    assert decision.action == KEEP_GOING  # the case study: failover always wins
    assert "(assumed)" in decision.reason


def test_lookahead_recommends_a_reload_at_the_next_checkpoint_when_repair_is_far():
    # k = 1.5 for 10 more hours wastes 3.3 h; a 10-minute reload is cheaper
    far = _advisor_with_k(1.5, expected_repair_s=10 * HOUR)
    decision = far.decide(0.5 * HOUR, now=60.0)
    assert decision.action == RESTART_AT_NEXT_CHECKPOINT
    assert decision.reason.startswith("restart at the next checkpoint is cheaper")

    # the repair is due before the next checkpoint: nothing to gain from a reload
    near = _advisor_with_k(1.5, expected_repair_s=0.5 * HOUR)
    assert near.decide(0.5 * HOUR, now=60.0).action == KEEP_GOING


def test_to_event_is_an_advice_event():
    event = _advisor_with_k(1.5).decide(0.9 * HOUR).to_event()
    assert event["kind"] == "advice"
    assert event["action"] == KEEP_GOING
    assert isinstance(event["reason"], str) and isinstance(event["time"], float)
    assert event["k"] == pytest.approx(1.5)


@pytest.mark.parametrize("kwargs", [
    {"checkpoint_interval_s": 0.0, "t_detect_s": 0.0},
    {"checkpoint_interval_s": HOUR, "t_detect_s": -1.0},
    {"checkpoint_interval_s": HOUR, "t_detect_s": 0.0, "assumed_k": 0.9},
])
def test_bad_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        Advisor(**kwargs)


def test_bad_inputs_are_rejected():
    advisor = Advisor(checkpoint_interval_s=HOUR, t_detect_s=0.0)
    with pytest.raises(ValueError):
        advisor.record_step(0.0)
    with pytest.raises(ValueError):
        advisor.decide(2 * HOUR)


def test_advisor_imports_neither_torch_nor_the_extension():
    # Load the module from its file so the check does not depend on the package's
    # __init__ (which registers the backend).
    path = os.path.join(REPO, "torch_reccl", "advisor.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('advisor', {path!r})\n"
        "module = sys.modules['advisor'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules and 'torch_reccl._C' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
