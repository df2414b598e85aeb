"""PyTorch's own distributed test suite, fast subset, on reccl and Gloo at two ranks.

Runs bench/torch_dist_suite.py (torch/testing/_internal/distributed/distributed_test.py
of the installed torch) on its FAST_SUBSET: collectives, p2p, groups, DDP basics,
the sparse all_reduce and DDP's logging data. Every test that passes on Gloo must
pass on reccl; the ones the suite gates on the name "gloo" must pass with the gate
seeing "gloo" while reccl makes every group (mode reccl-as-gloo). The harness
bounds every test (--test-timeout) and every worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(ROOT, "bench", "torch_dist_suite.py")
TEST_TIMEOUT_S = 90
RUN_TIMEOUT_S = 1500


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_fast_subset_passes_on_reccl_wherever_on_gloo(tmp_path):
    out = tmp_path / "suite.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, HARNESS, "--world-sizes", "2", "--subset", "fast",
                          "--test-timeout", str(TEST_TIMEOUT_S), "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())["summaries"][0]
    counts = summary["counts"]
    # The subset really ran: most of it passes on Gloo at two ranks.
    assert counts["gloo"]["passed"] >= 15, (counts, run.stdout)
    assert counts["reccl"]["hang"] == 0 and counts["reccl-as-gloo"]["hang"] == 0, run.stdout
    assert summary["reccl_failures_not_gated"] == [], run.stdout
    assert summary["name_gated_failing_as_gloo"] == [], run.stdout
