"""Training through real faults in the emulated fabric, with DCR.

Two emulated hosts with two rails each run a small training loop over the
"reccl" backend (torch_reccl/bench/fabric_train.py, one channel per NIC). A fault hits at a
chosen step: a NIC losing its link, a whole rail's switch going down, a flapping
link, a silent blackhole, a NIC going down and coming back. The final parameters
and the loss curve must be bit-identical to the fault-free run, and DCR must
engage (and, after healing, disengage) at the same op on every rank, as the
rebalance events show. Needs root (network namespaces).
"""
from __future__ import annotations

import os

import pytest

from training_fabric import Run, check_identical, emulated_fabric, rebalance_ops

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

fabric = emulated_fabric(hosts=2, name="tr")


@pytest.fixture(scope="module")
def reference(fabric):
    run = Run(fabric)
    results = run.results()
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["channels"] == 2
    assert all(not r["rebalances"] for r in results), results
    return results[0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["nic_down", "rail_down",
                                   pytest.param("blackhole", marks=pytest.mark.needs_nft), "flap"])
def test_fault_then_heal(fabric, reference, fault):
    run = Run(fabric, pauses=(20, 40))
    flapper = None
    try:
        run.wait_pause(20)
        if fault == "nic_down":
            fabric.nic_down(0, 1)
        elif fault == "rail_down":
            fabric.rail_down(1)
        elif fault == "blackhole":
            fabric.blackhole(1, 1)
        elif fault == "flap":
            flapper = fabric.flap(0, 1, period_s=0.2, count=6)
        run.resume("" if fault == "flap" else "avoid")
        run.wait_pause(40)
        if flapper is not None:
            assert flapper.join(timeout=30), "flapping did not end"
        fabric.heal()
        run.resume("clear")
        results = run.results()
    finally:
        if flapper is not None:
            flapper.stop()
        fabric.heal()
        run.kill()
    check_identical(results, reference)
    switches = rebalance_ops(results)
    if fault != "flap":  # a flap may heal between two collectives: no plan needed
        assert len(switches) >= 2, switches
        assert "channel 1 of 2 carry no data" in switches[0][2], switches
        assert 20 <= switches[0][0], switches
        assert switches[-1][2] == "every channel carries data", switches
        assert switches[-1][0] >= 40 * 2, switches  # two collectives per step


@pytest.mark.timeout(120)
def test_nic_down_to_the_end(fabric, reference):
    run = Run(fabric, pauses=(10,))
    try:
        run.wait_pause(10)
        fabric.nic_down(1, 0)
        run.resume("avoid")
        results = run.results()
    finally:
        fabric.heal()
        run.kill()
    check_identical(results, reference)
    switches = rebalance_ops(results)
    assert len(switches) == 1 and "channel 0 of 2 carry no data" in switches[0][2], switches


@pytest.mark.timeout(120)
def test_dcr_disabled(fabric, reference):
    run = Run(fabric, pauses=(10,), env={"RECCL_DCR": "0"})
    try:
        run.wait_pause(10)
        fabric.nic_down(0, 1)
        run.resume()
        results = run.results()
    finally:
        fabric.heal()
        run.kill()
    check_identical(results, reference)
    assert rebalance_ops(results) == []
