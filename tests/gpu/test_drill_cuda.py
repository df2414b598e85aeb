"""GPU check of ``reccl drill --device cuda --compare nccl``: a small model trains
on CUDA tensors with NCCL through torch_reccl's plugin (two ranks, each its own NCCL
host, sharing the GPUs), loses host 0's NIC 0 at step 30 and gets it back at step 70;
it must finish every step with the final parameters and every step's loss bit-identical
to its fault-free run, fail over and back. NCCL's own socket transport runs the same
job and schedule first; its row must be in the comparison.

Two modes: inject (any GPU host: the fault is inject_fault inside the ranks, which
NCCL's sockets never see, so the baseline's row must say "no fault applied") and
fabric (root and pyroute2: real veth link events for both, skipped otherwise).

Run with the other GPU checks: ``python -m pytest -m gpu tests/gpu`` (docs/gpu_tests.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_reccl.drill.cli import fabric_problem

from conftest import REPO, needs_gpus

pytestmark = needs_gpus(1)

DRILL_TIMEOUT_S = 420


@pytest.mark.parametrize("mode", ["inject", "fabric"])
def test_cuda_drill_survives_a_nic_loss_bit_identically_beside_nccl_sockets(tmp_path, mode):
    if mode == "fabric" and fabric_problem():
        pytest.skip(f"the fabric drill needs the emulated fabric: {fabric_problem()}")
    record_path = tmp_path / "drill.json"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "torch_reccl", "drill", "--device", "cuda", "--compare", "nccl",
         "--mode", mode, "--steps", "100", "--fault", "h0nic0:down@step 30,h0nic0:up@step 70",
         "--verify", "--no-plot", "--json", str(record_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=DRILL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "CUDA tensors, NCCL through torch_reccl's plugin" in done.stderr, done.stderr[-2000:]
    record = json.loads(record_path.read_text())
    assert record["verify"]["identical"] and record["verify"]["losses_identical"], record["verify"]
    events = record["run"]["events"]
    kinds = {e["kind"] for e in events}
    assert {"failover", "failback"} <= kinds, sorted(kinds)
    rows = {row["backend"]: row for row in record["compare"]["rows"]}
    assert set(rows) == {"nccl", "reccl"}, rows
    assert rows["reccl"]["survived"] and rows["reccl"]["steps"] == 100, rows["reccl"]
    if mode == "inject":
        assert rows["nccl"]["survived"] and "no fault applied" in rows["nccl"]["note"], rows["nccl"]
    else:
        assert rows["nccl"]["faults_applied"] == 2 or not rows["nccl"]["survived"], rows["nccl"]
