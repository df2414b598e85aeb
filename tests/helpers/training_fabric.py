"""The emulated-fabric training runs that the fabric tests share
(test_training_fabric.py, test_halving_fabric.py, test_fabric.py): a module's
fabric fixture, a run of torch_reccl.bench.fabric_train per host, and the checks
of its results against the fault-free run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from torch_reccl.fabric import Fabric

from conftest import REPO, RankProcesses

WORKER = [sys.executable, "-m", "torch_reccl.bench.fabric_train"]
STEPS = 60
ENV = {"RECCL_HEARTBEAT_MS": "300", "RECCL_CONNECT_TIMEOUT_MS": "1000",
       "RECCL_NICS": "eth0,eth1"}


def reclaim_stale(name: str) -> None:
    """Tear down a fabric of this test-owned name left by a run that died
    (its owner process is gone); one whose owner still runs is left alone, and
    up() then says so."""
    owner = Fabric.builder_pid(name)
    if owner and os.path.exists(f"/proc/{owner}"):
        return
    Fabric.cleanup(name)  # idempotent: nothing left, nothing done


def emulated_fabric(hosts: int, name: str):
    """A module-scoped `fabric` fixture: `hosts` emulated hosts with two rails
    of 2 Gbit/s, up for the module's tests and torn down after."""

    @pytest.fixture(scope="module")
    def fabric():
        reclaim_stale(name)
        fab = Fabric(hosts=hosts, rails=2, rate_mbit=2000, name=name)
        fab.up()
        try:
            yield fab
        finally:
            fab.down()

    return fabric


class Run(RankProcesses):
    """One training run: a worker per host; rank 0 pauses at the given steps."""

    _port = 29600

    def __init__(self, fab: Fabric, pauses=(), env=None, deadline=90.0, argv=()):
        Run._port += 1
        self.fab = fab
        self.deadline = time.monotonic() + deadline
        argv_common = ["--world", str(fab.hosts), "--master", fab.mgmt_ip(0),
                       "--port", str(Run._port), "--steps", str(STEPS)]
        for step in pauses:
            argv_common += ["--pause", str(step)]
        argv_common += list(argv)  # more fabric_train options
        full_env = {**os.environ, **ENV, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
        self.procs = [
            fab.popen(h, [*WORKER, "--rank", str(h)] + argv_common,
                      env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
            for h in range(fab.hosts)
        ]

    def wait_pause(self, step: int) -> None:
        line = self._readline(0)
        assert line.strip() == f"PAUSE {step}", f"expected PAUSE {step}, got {line!r}\n{self.logs()}"

    def resume(self, wait_for: str = "") -> None:
        self.procs[0].stdin.write(f"go {wait_for}\n")
        self.procs[0].stdin.flush()

    def _readline(self, rank: int) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.procs[rank].stdout, selectors.EVENT_READ)
        left = self.deadline - time.monotonic()
        if left <= 0 or not sel.select(timeout=left):
            self.kill()
            raise AssertionError(f"rank {rank} produced no output in time\n{self.logs()}")
        return self.procs[rank].stdout.readline()

    def results(self) -> list:
        out = []
        for rank, proc in enumerate(self.procs):
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"rank {rank} hung\n{self.logs()}")
            assert proc.returncode == 0, f"rank {rank} failed ({proc.returncode}):\n{stderr[-4000:]}"
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out


def check_identical(results, reference) -> None:
    for r in results:
        assert r["params"] == reference["params"], "final parameters differ from the fault-free run"
        assert r["losses"] == reference["losses"], "loss curve differs from the fault-free run"


def rebalance_ops(results) -> list:
    """(op, plan, channels carrying no data) per rank; the same list on every rank."""
    per_rank = [[(e["op"], e["plan"], e["detail"]) for e in r["rebalances"]] for r in results]
    for rank, events in enumerate(per_rank[1:], start=1):
        assert events == per_rank[0], f"rank 0 and rank {rank} switched plans differently: {per_rank}"
    return per_rank[0]
