"""The FaultPolicy acting in the emulated fabric, under torchrun (bench/advisor_drill.py's runs,
torch_reccl/bench/advisor_drill.py).

Two hosts, two rails, each host under its own ``torchrun --max-restarts 2``; host
0's NIC 1 loses its link (a real carrier loss) and stays down. Under the advised
rule the job runs degraded to its next checkpoint, saves, exits 75 on every rank at
the same step; torchrun starts it again, it resumes from that checkpoint with eth1
still down -- the library reads the link flags at start and the job trains on eth0
-- and finishes with the parameters of the fault-free run bit for bit. Under the
restart rule it exits at once and redoes the steps since its last checkpoint.
Needs root (network namespaces).
"""
from __future__ import annotations

import os

import pytest

from torch_reccl.bench import advisor_drill
from torch_reccl.fabric import Fabric

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

STEPS, FAULT_STEP, EVERY = 60, 15, 20


@pytest.fixture(scope="module")
def fabric():
    fab = Fabric(hosts=2, rails=2, rate_mbit=200, name="adv")
    fab.up()
    try:
        yield fab
    finally:
        fab.down()


@pytest.fixture(scope="module")
def reference(fabric):
    return run(fabric, "fault_free")


def run(fabric, rule):
    args = advisor_drill.parse_args(["--steps", str(STEPS), "--fault-step", str(FAULT_STEP),
                                     "--checkpoint-every", str(EVERY), "--run-timeout-s", "240"])
    return advisor_drill.run_once(fabric, args, rule)


def digests(result) -> set:
    assert set(result["final"]) == {"0", "1"}, result
    return {r["params_sha256"] for r in result["final"].values()}


@pytest.mark.timeout(300)
def test_advised_checkpoints_exits_and_resumes_on_the_nics_that_are_up(fabric, reference):
    result = run(fabric, "advised")
    assert [e["action"] for e in result["exits"]] == ["checkpoint_and_exit"], result["exits"]
    exit_step = result["exits"][0]["step"]
    assert exit_step % EVERY == 0 and exit_step > FAULT_STEP
    first, restarted = result["starts"]
    assert first["resumed_from"] == 0 and first["nics_up"] == {"eth0": True, "eth1": True}
    assert restarted["restart"] == 1 and restarted["resumed_from"] == exit_step
    assert restarted["nics_up"] == {"eth0": True, "eth1": False}  # known at start
    assert result["steps_lost"] == 0 and result["exit_codes"] == [0, 0]
    assert digests(result) == digests(reference) and len(digests(reference)) == 1


@pytest.mark.timeout(300)
def test_restart_exits_at_once_and_redoes_the_steps_since_the_checkpoint(fabric, reference):
    result = run(fabric, "restart")
    assert [e["action"] for e in result["exits"]] == ["exit_now"], result["exits"]
    exit_step = result["exits"][0]["step"]
    restarted = result["starts"][1]
    assert restarted["resumed_from"] == (exit_step // EVERY) * EVERY
    assert result["steps_lost"] == exit_step - restarted["resumed_from"] > 0
    assert digests(result) == digests(reference)
