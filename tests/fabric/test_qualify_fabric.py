"""`reccl qualify` on the emulated fabric (root): a rail that does not connect fails
the run, naming the rail, both NICs and why.

Two hosts x two rails; host 1's eth1 loses its link (its bridge port down) before
the ranks start, one rank per host, each in its host's network namespace as on a
cluster (no --local: the ranks get torchrun's variables). The inventory flags the
NIC down, reachability fails rail 1 in both directions while rail 0 connects, and
the checks that need every rail do not run.
"""
from __future__ import annotations

import json
import sys

import pytest

from torch_reccl.cli.launch import FabricPlacement, Job
from torch_reccl.fabric import Fabric, require_root

NAME = "tqf1"


@pytest.mark.timeout(120)
def test_a_rail_that_does_not_connect_fails_reachability_naming_it(tmp_path):
    require_root()
    out, md = tmp_path / "q.json", tmp_path / "q.md"
    with Fabric(hosts=2, rails=2, name=NAME) as fabric:
        fabric.nic_down(1, 1)
        argv = [sys.executable, "-m", "torch_reccl.qualify", "--json", str(out), "--report", str(md),
                "--reach-timeout", "3"]
        with Job(FabricPlacement(fabric), argv) as job:
            assert job.wait(90), job.logs()
            codes, logs = job.exit_codes(), job.logs(lines=40)
    assert codes == [1, 1], logs
    record = json.loads(out.read_text())
    checks = record["checks"]
    assert {name: c["status"] for name, c in checks.items()} == {
        "inventory": "failed", "reach": "failed", "perf": "skipped", "failover": "skipped"}, logs
    assert checks["inventory"]["problems"] == [
        "host 1 (" + record["hosts"][1]["hostname"] + "): rail 1 NIC eth1 (198.18.1.2) is down (operstate down)"]
    problems = checks["reach"]["problems"]
    assert len(problems) == 2, problems
    assert problems[0].startswith("rail 1: host 0 eth1 (198.18.1.1) -> host 1 eth1 (198.18.1.2): TCP does not "
                                  "connect: from 198.18.1.1 to 198.18.1.2:"), problems
    assert problems[1].startswith("rail 1: host 1 eth1 (198.18.1.2) -> host 0 eth1 (198.18.1.1): TCP does not "
                                  "connect: from 198.18.1.2 to 198.18.1.1:"), problems
    rail0 = [r for r in checks["reach"]["rows"] if r["rail"] == 0]
    assert len(rail0) == 2 and all(r["tcp"]["connected"] and r["hello"]["ok"] for r in rail0), rail0
    assert all(not r["hello"]["ok"] for r in checks["reach"]["rows"] if r["rail"] == 1)
    assert "verdict: FAILED" in logs and "rail 1: host 0 eth1 (198.18.1.1) -> host 1 eth1" in md.read_text()
