"""The short soak: 3 minutes of random combined faults on 4 emulated hosts x 2 rails.

`reccl soak --duration 3m --seed 1` applies every fault kind of its schedule
(NICs and rails down, flaps, blackholes, slow and lossy NICs, a host's every NIC
down, two hosts without a common rail), overlapping, while four ranks run every
collective and point-to-point op checked against independently computed values,
and training steps whose parameters must match a fault-free replay bit for bit;
beside them the plugin stream carries checked messages from host 0 to host 1
through the NCCL net plugin library alone, through the same faults. It must end
with verdict OK: no wrong value or message, no plugin error, no stall past the
bound, no crash, resources of the ranks and of the stream's ends back to their
warm-up floors (docs/soak.md, "What fails a soak"), and the fabric gone. The
two-hour run is in docs/benchmarks.md ("Soak").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the emulated fabric needs root")

NAME = "sk"


@pytest.mark.timeout(1000)
def test_three_minutes_of_random_combined_faults_end_exact_with_flat_resources(tmp_path):
    from torch_reccl.fabric import Fabric

    Fabric.cleanup(NAME)  # what a killed run of this test left behind
    report = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "torch_reccl", "soak", "--duration", "3m", "--seed", "1",
             "--settle", "30s", "--name", NAME, "--json", str(report),
             "--plot", str(tmp_path / "soak.png"), "--log-dir", str(tmp_path / "logs")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    finally:
        Fabric.cleanup(NAME)
    tail = "\n".join(run.stdout.splitlines()[-40:])
    assert run.returncode == 0, f"{tail}\n--- stderr:\n{run.stderr[-4000:]}"
    assert "verdict: OK" in run.stdout
    data = json.loads(report.read_text())
    assert data["ok"] and data["problems"] == []
    applied = {a["kind"] for a in data["run"]["faults_applied"] if a["what"] == "apply"}
    assert {"nic_down", "blackhole", "flap", "host_down", "split"} <= applied, applied
    assert data["faults_applied"] == len(data["schedule"]) >= 15
    assert data["run"]["wrong"] == []
    assert data["run"]["replay"]["identical"] is True
    assert data["iterations"] > 100
    assert data["interruptions"]["failover"]["count"] > 0
    assert data["scheduling_gaps"]["count"] > 1000  # the probe ran beside the job
    assert all(r["fds"][1] - r["fds"][0] <= r["explained"]["fds"]
               for r in data["resources"].values())
    # the plugin stream ran from the job's start to its end, every message intact
    stream = data["plugin"]
    assert stream["wrong"] == 0 and stream["errors"] == 0, stream
    assert stream["messages"] == stream["sent"] > 1000 and stream["bytes"] > 500 << 20, stream
    assert set(data["run"]["plugin"]["done"]) == {"send", "recv"}
    assert stream["longest_gap_s"] < 30.0 + sum(b - a for a, b in data["outages"])
    assert {"plugin-send", "plugin-recv"} <= set(data["resources"])
    assert "plugin stream (host 0 -> host 1)" in run.stdout
    assert os.path.getsize(tmp_path / "soak.png") > 10_000
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"reccl-{NAME}-")]
