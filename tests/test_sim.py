"""Tests of the GPU-hour simulator and ``reccl sim`` (DESIGN.md §6)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import fields, replace

import numpy as np
import pytest

from torch_reccl import cli
from torch_reccl.sim import (
    POLICIES,
    ProgressBar,
    SimParams,
    analytic,
    expected_restart_cost_h,
    simulate,
    simulate_wall_hours,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE_STUDY = SimParams()
FAULTY_POLICIES = ("restart", "restart_scaling", "failover", "advised")


def _mean_extra(result, policy: str) -> float:
    return result.summary()[policy]["mean_extra_gpu_hours"]


@pytest.fixture
def sim_only_cli(monkeypatch):
    """The ``reccl`` entry point with only the sim subcommand, so these tests do not
    depend on the other subcommands' modules."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"sim": "torch_reccl.sim"})
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


def test_failover_beats_restart_in_the_case_study_and_advice_beats_both():
    result = simulate(runs=2000, seed=2)
    advised, failover, restart = (_mean_extra(result, policy)
                                  for policy in ("advised", "failover", "restart"))
    assert advised < failover < restart


@pytest.mark.parametrize("changes", [
    {},
    {"link_failure_pct_per_month": 0.228},        # 4x the faults: long overlapping failovers
    {"k_by_faults": (1.5,), "t_detect_h": 0.0},   # slow failover, free detection
    {"k_by_faults": (2.0,), "t_detect_h": 0.1, "repair_h": 4.0},
])
def test_failover_with_the_advisor_is_never_worse_than_restart(changes):
    result = simulate(replace(CASE_STUDY, **changes), runs=1000, seed=3,
                      policies=("restart", "advised"))
    assert _mean_extra(result, "advised") <= _mean_extra(result, "restart")


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


def test_restart_matches_the_closed_form_model():
    result = simulate(runs=2000, seed=5, policies=("restart", "advised"))
    expected = next(point for point in analytic() if point.gpus == CASE_STUDY.gpus)
    restart_extra_h = _mean_extra(result, "restart") / CASE_STUDY.gpus
    advised_extra_h = _mean_extra(result, "advised") / CASE_STUDY.gpus
    assert restart_extra_h == pytest.approx(
        expected.restart_hours - expected.fault_free_hours, rel=0.05)
    # With 24 h repairs the advisor reloads at the next checkpoint, as the closed form assumes.
    assert advised_extra_h == pytest.approx(
        expected.failover_hours - expected.fault_free_hours, rel=0.1)


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
    for policy in POLICIES:
        assert policy in out
    assert "saved vs restart" in out

    document = json.loads(path.read_text())
    assert set(document["policies"]) == set(POLICIES)
    for stats in document["policies"].values():
        assert {"median_gpu_hours", "p99_gpu_hours", "median_extra_gpu_hours",
                "p99_extra_gpu_hours"} <= set(stats)
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


def test_python_dash_m_torch_reccl_sim(tmp_path):
    path = tmp_path / "sim.json"
    completed = subprocess.run(
        [sys.executable, "-m", "torch_reccl", "sim", "--runs", "100", "--seed", "1",
         "--no-plot", "--json", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "advised" in completed.stdout
    assert set(json.loads(path.read_text())["policies"]) == set(POLICIES)
