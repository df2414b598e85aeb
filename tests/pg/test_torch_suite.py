"""PyTorch's own distributed test suite on reccl and Gloo at two ranks.

Runs bench/torch_dist_suite.py (torch/testing/_internal/distributed/distributed_test.py
of the installed torch): its FAST_SUBSET (collectives, p2p, groups, DDP basics, the
sparse all_reduce and DDP's logging data) with ranks spawned as upstream does, and
every test of the suite with forked ranks (minutes instead of hours). Every test that
passes on Gloo must pass on reccl; the ones the suite gates on the name "gloo" must
pass with the gate seeing "gloo" while reccl makes every group (mode reccl-as-gloo),
except where torch itself refuses a non-Gloo backend. The harness bounds every test
(--test-timeout) and every worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(ROOT, "bench", "torch_dist_suite.py")  # run by path; torch_reccl from ROOT
TEST_TIMEOUT_S = 90
RUN_TIMEOUT_S = 1500


# torch.distributed.monitored_barrier refuses every backend but Gloo
# (distributed_c10d.py); docs/compatibility.md, "What torch decides".
TORCH_REFUSAL = "monitored_barrier is only implemented for GLOO backend"


def run_suite(tmp_path, *args):
    out = tmp_path / "suite.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, HARNESS, "--world-sizes", "2", *args,
                          "--test-timeout", str(TEST_TIMEOUT_S), "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    return result["summaries"][0], result["results"]["2"], run.stdout


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_fast_subset_passes_on_reccl_wherever_on_gloo(tmp_path):
    summary, _, stdout = run_suite(tmp_path, "--subset", "fast")
    counts = summary["counts"]
    # The subset really ran: most of it passes on Gloo at two ranks.
    assert counts["gloo"]["passed"] >= 15, (counts, stdout)
    assert counts["reccl"]["hang"] == 0 and counts["reccl-as-gloo"]["hang"] == 0, stdout
    assert summary["reccl_failures_not_gated"] == [], stdout
    assert summary["name_gated_failing_as_gloo"] == [], stdout


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_whole_suite_passes_on_reccl_wherever_on_gloo(tmp_path):
    summary, results, stdout = run_suite(tmp_path, "--start-method", "fork")
    counts = summary["counts"]
    # The whole suite ran: 285 tests in torch 2.13, 91 of them passing on Gloo at two ranks.
    assert sum(counts["gloo"].values()) >= 250 and counts["gloo"]["passed"] >= 80, (counts, stdout)
    assert all(c["hang"] == 0 for c in counts.values()), stdout
    assert summary["reccl_failures_not_gated"] == [], stdout
    for test in summary["name_gated_failing_as_gloo"]:
        detail = results["reccl-as-gloo"][test]["detail"]
        assert TORCH_REFUSAL in detail, (test, detail, stdout)
