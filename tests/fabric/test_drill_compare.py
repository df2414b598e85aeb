"""`reccl drill --compare gloo`: the same job and fault schedule over Gloo, then
over reccl, each checked against its own fault-free run.

In the emulated fabric (root) a NIC of host 1 loses its link for good: Gloo,
pinned to that NIC, stops and dies at its collective timeout; reccl fails over
and ends bit-identical. Without root (inject_fault on loopback NICs) Gloo cannot
be given the fault: its run is fault-free and the report says so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_reccl import cli

from conftest import REPO as ROOT


def rows_by_backend(record) -> dict:
    return {row["backend"]: row for row in record["compare"]["rows"]}


@pytest.mark.timeout(150)
def test_a_nic_lost_for_good_kills_gloo_and_not_reccl(tmp_path):
    from torch_reccl.fabric import require_root

    require_root()
    out = tmp_path / "drill.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "torch_reccl", "drill", "--compare", "gloo", "--hosts", "2", "--rails", "2",
         "--rate-mbit", "1000", "--duration", "8s", "--fault", "h1nic0:down@2s", "--collective-timeout", "8",
         "--stall-timeout", "20", "--name", "tdcg", "--plot", str(tmp_path / "drill.png"),
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    rows = rows_by_backend(record)
    gloo, reccl = rows["gloo"], rows["reccl"]
    assert not gloo["survived"], gloo
    assert gloo["faults_applied"] == 1 and gloo["died_at_s"] is not None
    assert gloo["longest_stall_s"] >= 7, gloo  # it waited out its 8 s collective timeout
    assert gloo["identical"] is None  # a run that died is not compared
    assert reccl["survived"] and reccl["identical"] is True, reccl
    assert reccl["steps"] > gloo["steps"]
    assert "comparison (same fault schedule, same fabric):" in done.stdout
    assert "bit-identical to its fault-free run" in done.stdout
    assert (tmp_path / "drill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(150)
def test_without_root_gloo_runs_fault_free_and_says_so(tmp_path, monkeypatch, capsys):
    out = tmp_path / "drill.json"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as a user would run it
    code = cli.main(["drill", "--compare", "gloo", "--steps", "24", "--fault", "h1nic0:down@step 6",
                     "--fault", "h1nic0:up@step 14", "--no-plot", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    record = json.loads(out.read_text())
    assert record["mode"] == "inject"
    rows = rows_by_backend(record)
    assert rows["gloo"]["survived"] and rows["gloo"]["faults_applied"] == 0
    assert "no fault to give Gloo" in rows["gloo"]["note"]
    assert rows["reccl"]["survived"] and rows["reccl"]["faults_applied"] == 2
    assert rows["gloo"]["identical"] is True and rows["reccl"]["identical"] is True
    assert record["compare"]["baseline"]["applied"] == []
    assert "survived (no fault applied)" in captured.out
