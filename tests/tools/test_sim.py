"""Tests of the GPU-hour simulator and ``reccl sim`` (docs/design.md §10)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import fields, replace

import numpy as np
import pytest

from torch_reccl import cli
from torch_reccl.sim.simulator import (
    ADVISED,
    POLICIES,
    ProgressBar,
    SimParams,
    SimResult,
    analytic,
    expected_restart_cost_h,
    format_table,
    simulate,
    simulate_wall_hours,
)

from conftest import REPO

CASE_STUDY = SimParams()
FAULTY_POLICIES = tuple(policy for policy in POLICIES if policy != "fault_free")


def _mean_extra(result, policy: str) -> float:
    return result.summary()[policy]["mean_extra_gpu_hours"]


@pytest.fixture
def sim_only_cli(monkeypatch):
    """The ``reccl`` entry point with only the sim subcommand, so these tests do not
    depend on the other subcommands' modules."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"sim": "torch_reccl.sim.simulator"})
    return cli.main


def test_case_study_parameters():
    p = CASE_STUDY
    assert (p.gpus, p.hosts, p.links, p.tor_switches) == (16384, 2048, 16384, 512)
    assert p.k_by_faults == (1.03, 1.20, 1.50) and p.dp_degree == 16
    # 0.057% of 16,384 links and 0.051% of 512 switches per month, over 1925 h
    expected_faults = (16384 * 0.00057 + 512 * 0.00051) * 1925 / (365 * 24 / 12)
    assert p.fault_rate_per_h * p.fault_free_hours == pytest.approx(expected_faults)
    np.testing.assert_allclose(p.slowdown(np.array([0, 1, 2, 3, 7])), [1, 1.03, 1.2, 1.5, 1.5])


def test_without_faults_every_policy_equals_fault_free():
    no_faults = replace(CASE_STUDY, link_failure_pct_per_month=0.0,
                        switch_failure_pct_per_month=0.0)
    result = simulate(no_faults, runs=300, seed=1)
    for policy in POLICIES:
        np.testing.assert_array_equal(result.gpu_hours[policy], result.fault_free_gpu_hours)


class _OneFault:
    """Stands in for the simulator's random generator: one fault at wall-clock hour
    at_h, then none, so a run's wall time can be worked out by hand."""

    def __init__(self, at_h: float, params: SimParams) -> None:
        self.draws = [at_h * params.fault_rate_per_h]  # the simulator divides by the rate

    def standard_exponential(self, size: int) -> np.ndarray:
        return np.full(size, self.draws.pop() if self.draws else np.inf)


def _wall_with_one_fault(policy: str, params: SimParams, at_h: float) -> float:
    return float(simulate_wall_hours(policy, params, 1, _OneFault(at_h, params))[0])


# 20 h of work, 1 h checkpoints; a fault at 10.25 h, 0.25 h after a checkpoint.
# Eq. 4: (1 * 0.2 - 0.1) / 1.2 = 0.083 h < 0.25 h, so every advised policy fails over.
ONE_FAULT = replace(CASE_STUDY, fault_free_hours=20.0, k_by_faults=(1.2,), t_detect_h=0.1,
                    t_reload_h=0.5, t_timeout_h=0.01)


@pytest.mark.parametrize("policy, repair_h, wall_h", [
    # eq. 2 to the next checkpoint: 0.01 + 1.2 * 0.75 + 0.5 = 1.41 h, then the 9 h left;
    # the reload swaps the hardware out, so when the repair would come does not matter
    ("degrade_until_checkpoint", 24.0, 10.25 + 1.41 + 9),
    ("degrade_until_checkpoint", 0.1, 10.25 + 1.41 + 9),
    # a 24 h repair is far off: the look-ahead reloads at the checkpoint too
    ("advised", 24.0, 10.25 + 1.41 + 9),
    # repaired 0.1 h after the fault: no reload, 0.09 h at k (after the 0.01 h stall)
    # costs 0.09 * 0.2 / 1.2 = 0.015 h
    ("advised", 0.1, 20 + 0.01 + 0.015),
    # the 9.75 h of work left all run at k = 1.2: the repair comes after the job ends
    ("degrade_until_repair", 24.0, 10.25 + 0.01 + 1.2 * 9.75),
])
def test_one_fault_costs_what_each_policy_says_by_hand(policy, repair_h, wall_h):
    params = replace(ONE_FAULT, repair_h=repair_h)
    assert _wall_with_one_fault(policy, params, at_h=10.25) == pytest.approx(wall_h)


@pytest.mark.parametrize("policy", ADVISED)
@pytest.mark.parametrize("t_elapsed, wall_h", [
    # k = 1.5, T_detect = 0: eq. 4 puts the threshold at a third of the hour.
    # Below it, restart (eq. 1): 0.01 + 0 + 0.5 + 1 = 1.51 h to the next checkpoint,
    # against 0.01 + 1.5 * 0.7 + 0.5 = 1.56 h failing over (eq. 2).
    (0.30, 10.30 + 1.51 + 9),
    # Above it, fail over: 0.01 + 1.5 * 0.64 + 0.5 = 1.47 h, against 1.51 h restarting.
    (0.36, 10.36 + 1.47 + 9),
])
def test_advised_policies_restart_exactly_below_the_eq_4_threshold(policy, t_elapsed, wall_h):
    params = replace(ONE_FAULT, k_by_faults=(1.5,), t_detect_h=0.0)
    assert _wall_with_one_fault(policy, params, at_h=10 + t_elapsed) == pytest.approx(wall_h)


def test_degrade_until_repair_keeps_the_numbers_of_the_old_failover_policy():
    # recorded from policy "failover" at commit cd5f954, before it was renamed
    result = simulate(runs=1000, seed=12, policies=("degrade_until_repair",))
    assert result.gpu_hours["degrade_until_repair"].sum() == pytest.approx(
        31992638874.44644, rel=1e-12)
    assert _mean_extra(result, "degrade_until_repair") == pytest.approx(
        453438.8744464431, rel=1e-12)


def test_in_the_case_study_eq_2_beats_degrading_until_repair_which_beats_restart():
    result = simulate(runs=2000, seed=2)
    until_checkpoint, advised, until_repair, restart = (
        _mean_extra(result, policy) for policy in (
            "degrade_until_checkpoint", "advised", "degrade_until_repair", "restart"))
    assert until_checkpoint < until_repair < restart
    # 24 h repairs: the look-ahead always reloads at the next checkpoint, as eq. 2 does
    assert advised == until_checkpoint


@pytest.mark.parametrize("changes", [
    {},
    {"link_failure_pct_per_month": 0.228},        # 4x the faults: long overlapping failovers
    {"k_by_faults": (1.5,), "t_detect_h": 0.0},   # slow failover, free detection
    {"k_by_faults": (2.0,), "t_detect_h": 0.1, "repair_h": 4.0},
])
def test_failover_with_the_advisor_is_never_worse_than_restart(changes):
    result = simulate(replace(CASE_STUDY, **changes), runs=1000, seed=3,
                      policies=("restart",) + ADVISED)
    for policy in ADVISED:
        assert _mean_extra(result, policy) <= _mean_extra(result, "restart"), policy


def test_gpu_hours_grow_with_the_failure_rate():
    means = {policy: [] for policy in FAULTY_POLICIES}
    for scale in (0.3, 1.0, 3.0):
        params = replace(CASE_STUDY, link_failure_pct_per_month=0.057 * scale,
                         switch_failure_pct_per_month=0.051 * scale)
        result = simulate(params, runs=1000, seed=4, policies=FAULTY_POLICIES)
        for policy in FAULTY_POLICIES:
            means[policy].append(_mean_extra(result, policy))
    for policy, values in means.items():
        assert values[0] < values[1] < values[2], (policy, values)


def test_same_seed_same_result_other_seed_other_result():
    first = simulate(runs=1500, seed=7, policies=FAULTY_POLICIES)
    again = simulate(runs=1500, seed=7, policies=FAULTY_POLICIES,
                     progress=ProgressBar(8, io.StringIO()))
    other = simulate(runs=1500, seed=8, policies=FAULTY_POLICIES)
    for policy in FAULTY_POLICIES:
        np.testing.assert_array_equal(first.gpu_hours[policy], again.gpu_hours[policy])
        assert not np.array_equal(first.gpu_hours[policy], other.gpu_hours[policy])


def test_restart_and_eq_2_match_the_closed_form_model():
    result = simulate(runs=2000, seed=5, policies=("restart", "degrade_until_checkpoint"))
    expected = next(point for point in analytic() if point.gpus == CASE_STUDY.gpus)
    restart_extra_h = _mean_extra(result, "restart") / CASE_STUDY.gpus
    failover_extra_h = _mean_extra(result, "degrade_until_checkpoint") / CASE_STUDY.gpus
    assert restart_extra_h == pytest.approx(
        expected.restart_hours - expected.fault_free_hours, rel=0.05)
    assert failover_extra_h == pytest.approx(
        expected.failover_hours - expected.fault_free_hours, rel=0.1)


def test_goodput_is_fault_free_over_mean_gpu_hours():
    fault_free = CASE_STUDY.gpus * CASE_STUDY.fault_free_hours
    # two runs: one without faults, one 50% longer; mean 1.25x, so goodput 0.8
    result = SimResult(params=CASE_STUDY, runs=2, seed=0,
                       gpu_hours={"restart": np.array([fault_free, 1.5 * fault_free])})
    stats = result.summary()["restart"]
    assert stats["goodput"] == pytest.approx(0.8)
    assert stats["mean_extra_gpu_hours"] == pytest.approx(0.25 * fault_free)
    row = format_table(result).splitlines()[3].split()
    assert row[0] == "restart" and "80.00%" in row


def test_restart_costs_downtime_and_the_lost_work():
    # one fault at most: the job is short and faults are rare, so E[extra] = rate * work * cost
    params = replace(CASE_STUDY, fault_free_hours=10.0, link_failure_pct_per_month=0.05,
                     switch_failure_pct_per_month=0.0)
    wall = simulate_wall_hours("restart", params, 20_000, np.random.default_rng(6))
    expected = params.fault_rate_per_h * params.fault_free_hours * expected_restart_cost_h(params)
    assert (wall - params.fault_free_hours).mean() == pytest.approx(expected, rel=0.1)


def test_analytic_covers_1k_to_64k_gpus_and_failover_never_loses():
    points = analytic()
    assert {1024, 4096, 16384, 65536} <= {point.gpus for point in points}
    improvements = [point.improvement_pct for point in points]
    assert all(value > 0 for value in improvements)
    assert improvements == sorted(improvements)  # more GPUs, more faults per hour of work
    for point in points:  # the job's compute is the same at every size
        assert point.gpus * point.fault_free_hours == pytest.approx(16384 * 1925)


@pytest.mark.parametrize("changes, message", [
    ({"gpus": 100}, "multiple of gpus_per_host"),
    ({"k_by_faults": (0.9,)}, "k_by_faults"),
    ({"dp_degree": 4096}, "dp_degree"),
    ({"repair_h": -1.0}, "repair_h"),
])
def test_bad_parameters_are_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(CASE_STUDY, **changes)


def test_cli_json_round_trip(sim_only_cli, tmp_path, capsys):
    path = tmp_path / "sim.json"
    argv = ["sim", "--runs", "300", "--seed", "11", "--json", str(path), "--no-plot",
            "--gpus", "8192", "--k-by-faults", "1.05", "1.3"]
    assert sim_only_cli(argv) == 0
    out = capsys.readouterr().out
    rows = out.splitlines()[3:3 + len(POLICIES)]  # after the header, a blank line, the columns
    assert [row.split()[0] for row in rows] == list(POLICIES)
    assert "saved vs restart" in out

    document = json.loads(path.read_text())
    assert set(document["policies"]) == set(POLICIES)
    for stats in document["policies"].values():
        assert {"median_gpu_hours", "p99_gpu_hours", "median_extra_gpu_hours",
                "p99_extra_gpu_hours", "mean_extra_gpu_hours", "goodput"} <= set(stats)
    params = document["params"]
    assert (params["runs"], params["seed"]) == (300, 11)
    model = SimParams(**{f.name: params[f.name] for f in fields(SimParams)})
    assert model == replace(CASE_STUDY, gpus=8192, k_by_faults=(1.05, 1.3))
    # the JSON holds exactly what the library computes for the same inputs
    expected = simulate(model, runs=300, seed=11).to_json()
    assert document["policies"] == expected["policies"]


def test_cli_analytic_json(sim_only_cli, tmp_path, capsys):
    path = tmp_path / "analytic.json"
    assert sim_only_cli(["sim", "--analytic", "--json", str(path)]) == 0
    assert "65536" in capsys.readouterr().out
    document = json.loads(path.read_text())
    assert {1024, 4096, 16384, 65536} <= set(document["gpus"])
    assert len(document["improvement_pct"]) == len(document["gpus"])
    assert document["params"]["gpus"] == 16384


def test_cli_writes_the_cdf_png(sim_only_cli, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "cdf.png"
    assert sim_only_cli(["sim", "--runs", "200", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


def test_cli_progress_bar_only_on_request_off_a_terminal(sim_only_cli, capsys):
    assert sim_only_cli(["sim", "--runs", "50", "--no-plot", "--policies", "restart"]) == 0
    assert capsys.readouterr().err == ""
    assert sim_only_cli(
        ["sim", "--runs", "50", "--no-plot", "--policies", "restart", "--progress"]) == 0
    assert "[" + "#" * 30 + "] 1/1" in capsys.readouterr().err


def test_cli_rejects_bad_values_with_exit_code_2(sim_only_cli, capsys):
    assert sim_only_cli(["sim", "--gpus", "100", "--no-plot"]) == 2
    assert "multiple of gpus_per_host" in capsys.readouterr().err


def test_cli_names_the_valid_policies_for_a_bad_one(sim_only_cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sim_only_cli(["sim", "--policies", "restart", "failover", "--no-plot"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'failover'" in err
    for policy in POLICIES:
        assert f"'{policy}'" in err


def test_cli_help_lists_every_policy(sim_only_cli, capsys):
    with pytest.raises(SystemExit):
        sim_only_cli(["sim", "--help"])
    out = capsys.readouterr().out
    for policy in POLICIES:
        assert f"\n  {policy} " in out  # its line in the list that describes the policies


def test_python_dash_m_torch_reccl_sim(tmp_path):
    path = tmp_path / "sim.json"
    completed = subprocess.run(
        [sys.executable, "-m", "torch_reccl", "sim", "--runs", "100", "--seed", "1",
         "--no-plot", "--json", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "degrade_until_checkpoint" in completed.stdout
    assert set(json.loads(path.read_text())["policies"]) == set(POLICIES)
