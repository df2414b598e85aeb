"""all_reduce, reduce_scatter and all_gather by recursive halving and doubling
(RECCL_ALGO=halving) through a real NIC fault in the emulated fabric, with DCR.

Three emulated hosts (a group that is not a power of two: host 0 folds into
host 1, which halves with host 2) with two rails each run the training loop of
tests/fabric_train.py, summing the gradient by one all_reduce or (--sync
shards) by reduce_scatter then all_gather. Host 0's NIC 1 loses its link at
step 20, mid-run (its connections fail over to NIC 0 below the engine, then
DCR moves every rank's data off channel 1 at one agreed op); it comes back at
step 40 and DCR gives channel 1 its data again. The final parameters and loss
curve must be bit-identical to the fault-free halving run of the same sync.
Needs root (network namespaces).
"""
from __future__ import annotations

import os

import pytest

from test_training_fabric import Run, check_identical, emulated_fabric, rebalance_ops

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

HALVING = {"RECCL_ALGO": "halving"}

fabric = emulated_fabric(hosts=3, name="hv")


@pytest.fixture(scope="module", params=["all_reduce", "shards"])
def sync(request):
    return request.param


@pytest.fixture(scope="module")
def reference(fabric, sync):
    results = Run(fabric, env=HALVING, argv=("--sync", sync)).results()
    assert len({r["params"] for r in results}) == 1
    assert all(not r["rebalances"] for r in results), results
    # Halving ran, not the ring: host 2 sends channel-1 data to its halving
    # partner, host 1 (the ring would send to its successor, host 0), and host
    # 1 to both the host folded into it and host 2.
    assert results[2]["send_peers"]["1"] == [1], results[2]["send_peers"]
    assert results[1]["send_peers"]["1"] == [0, 2], results[1]["send_peers"]
    return results[0]


@pytest.mark.timeout(150)
def test_nic_down_mid_run_then_heal(fabric, reference, sync):
    run = Run(fabric, pauses=(20, 40), env=HALVING, argv=("--sync", sync))
    try:
        run.wait_pause(20)
        fabric.nic_down(0, 1)
        run.resume("avoid")
        run.wait_pause(40)
        fabric.heal()
        run.resume("clear")
        results = run.results()
    finally:
        fabric.heal()
        run.kill()
    check_identical(results, reference)
    switches = rebalance_ops(results)
    assert len(switches) >= 2, switches
    assert "channel 1 of 2 carry no data" in switches[0][2], switches
    assert switches[-1][2] == "every channel carries data", switches
