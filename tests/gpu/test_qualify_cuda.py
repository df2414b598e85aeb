"""GPU check of ``reccl qualify --local 2``: two ranks, each its own host (their own
NCCL_HOSTID, NCCL's peer-to-peer and shared-memory transports off), sharing the
GPUs; the performance and failover checks run on CUDA tensors.

It must pass every check: NCCL loads torch_reccl's plugin (over TCP, the default)
and NCCL's own socket transport runs the same sizes in the same run, every checked
result exact on both; each of the two loopback rails lost in turn mid-stream, every
result exact, both ranks failing over and back.

Run with the other GPU checks: ``python -m pytest -m gpu tests/gpu`` (docs/gpu_tests.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, needs_gpus

pytestmark = needs_gpus(1)

QUALIFY_TIMEOUT_S = 540


def test_qualify_local_2_on_gpus_passes_with_the_plugin_beside_nccl_sockets(tmp_path):
    out, md = tmp_path / "q.json", tmp_path / "q.md"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "torch_reccl", "qualify", "--local", "2", "--device", "cuda",
                           "--json", str(out), "--report", str(md)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=QUALIFY_TIMEOUT_S)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads(out.read_text())
    checks = record["checks"]
    assert record["device"] == "cuda"
    assert {name: c["status"] for name, c in checks.items()} == {
        "inventory": "passed", "reach": "passed", "perf": "passed", "failover": "passed"}, record["failures"]
    perf = checks["perf"]
    assert perf["baseline"] == "NCCL Socket" and perf["plugin_transport"] == "tcp", perf
    assert {(r["op"], r["bytes"] >> 20) for r in perf["rows"]} == {
        (op, mib) for op in ("all_reduce", "all_gather") for mib in (16, 64, 256)}
    for row in perf["rows"]:
        assert row["reccl"]["wrong"] == 0 and row["baseline"]["wrong"] == 0, row
        assert row["reccl"]["busbw_gbps"] > 0 and row["baseline"]["busbw_gbps"] > 0, row
    failover = checks["failover"]
    assert failover["path"] == "NCCL through torch_reccl's plugin (tcp)"
    for rail in failover["rails"]:
        for rank in rail["ranks"]:
            assert rank["wrong_ops"] == 0 and rank["failover"] >= 1 and rank["failback"] >= 1, rail
    assert "## Performance" in md.read_text() and "NCCL Socket" in md.read_text()
