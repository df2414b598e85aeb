"""all_reduce, reduce_scatter and all_gather by recursive halving and doubling
(RECCL_ALGO=halving) through a real NIC fault in the emulated fabric, with DCR.

Three emulated hosts (a group that is not a power of two: host 0 folds into
host 1, which halves with host 2) with two rails each run the training loop of
torch_reccl/bench/fabric_train.py, summing the gradient by one all_reduce or (--sync
shards) by reduce_scatter then all_gather. Host 0's NIC 1 loses its link at
step 20, mid-run (its connections fail over to NIC 0 below the engine, then
DCR moves every rank's data off channel 1 at one agreed op); it comes back at
step 40 and DCR gives channel 1 its data again. The final parameters and loss
curve must be bit-identical to the fault-free halving run of the same sync.

On the same fabric, two hosts of four ranks each count the bytes their NICs
send per collective: halving meets its nearest partners first, so its large
steps stay on the host (the last test). Needs root (network namespaces).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import HELPERS
from training_fabric import ENV, REPO, Run, check_identical, emulated_fabric, rebalance_ops

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


BYTES_WORKER = os.path.join(HELPERS, "fabric_host_bytes.py")
PER_HOST = 4
MIB = 8


def host_bytes(fabric, algo, port):
    """Bytes each of hosts 0 and 1 sent through its NICs per collective, with
    PER_HOST ranks on each (tests/helpers/fabric_host_bytes.py)."""
    world = 2 * PER_HOST
    env = {**os.environ, **ENV, "RECCL_ALGO": algo}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    procs = [fabric.popen(rank // PER_HOST,
                          [sys.executable, BYTES_WORKER, "--rank", str(rank), "--world", str(world),
                           "--per-host", str(PER_HOST), "--master", fabric.mgmt_ip(0),
                           "--port", str(port), "--mib", str(MIB)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    out = []
    try:
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{algo}: rank {rank} failed ({proc.returncode}):\n{stderr[-4000:]}"
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(r["wrong"] == 0 for r in out), out
    return [out[0]["sent"], out[PER_HOST]["sent"]]


@pytest.mark.timeout(300)
def test_halving_keeps_its_large_steps_on_the_host(fabric):
    """Two hosts of four ranks: halving meets its nearest partners first, so
    its large steps stay on the host and each host's NICs send about what the
    algorithm's cross-host steps carry (all_reduce: S per host, reduce_scatter
    and all_gather: S/2), less than the host-grouped ring's 2(N-1)/N S and
    (N-1)/N S; farthest first would send 4 S and 2 S."""
    size = MIB << 20
    halving = host_bytes(fabric, "halving", 29750)
    ring = host_bytes(fabric, "ring", 29751)
    print(f"bytes sent through each host's NICs: halving {halving}, ring {ring}")
    expected = {"all_reduce": size, "reduce_scatter": size / 2, "all_gather": size / 2}
    for host in (0, 1):
        for op, want in expected.items():
            got = halving[host][op]
            assert 0.9 * want <= got <= 1.25 * want, \
                f"host {host} {op}: halving sent {got} bytes through its NICs, expected ~{want:.0f} " \
                f"(halving {halving}, ring {ring})"
            assert got < 0.75 * ring[host][op], f"host {host} {op}: halving {halving}, ring {ring}"
