"""Spreading (RECCL_SPREAD=on) under real faults in the emulated fabric.

Two hosts with 4 rails; host 0 sends to host 1 over 4 connections, one per NIC,
NCCL's way (torch_reccl/bench/spread_peer.py): through the NCCL net plugin's tables and
through the transport directly. Phases: fault-free; host 0's eth0 down (its
connection spreads over eth1-3); eth2 down too (two connections spread over eth1
and eth3); healed (failback to one path each); eth1 flapping. Every byte of every
message is checked by the receiver, and the bytes each NIC sent in a phase show
that the surviving NICs share the load evenly. Needs root (network namespaces).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from torch_reccl.fabric import Fabric

from conftest import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

PEER = [sys.executable, "-m", "torch_reccl.bench.spread_peer"]
NICS = [f"eth{i}" for i in range(4)]


def run_phases(tmp_path, driver, faults, rate_mbit=400, settle=1.0, extra=()):
    """Runs the peers through `faults` ({phase: fn(fab)}, in order); returns both results."""
    env = {**os.environ, "RECCL_NICS": ",".join(NICS), "RECCL_HEARTBEAT_MS": "300",
           "RECCL_CONNECT_TIMEOUT_MS": "1000", "RECCL_TRANSPORT": "tcp", "RECCL_SPREAD": "on",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    common = ["--driver", driver, "--dir", str(tmp_path), "--phases", ",".join(faults),
              "--step-bytes", str(32 << 20), "--warmup", "1", "--steps", "5", "--deadline", "150",
              *extra]
    with Fabric(hosts=2, rails=4, rate_mbit=rate_mbit, name="sp") as fab:
        procs = [fab.popen(host, [*PEER, "--role", role, *common], env=env,
                           stdout=subprocess.DEVNULL,
                           stderr=open(tmp_path / f"log-{role}", "w"))
                 for host, role in ((1, "recv"), (0, "send"))]
        deadline = time.monotonic() + 170
        for phase, fault in faults.items():
            while not (tmp_path / f"want-{phase}").exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(tmp_path)
                time.sleep(0.01)
            if fault is not None:
                fault(fab)
                if phase != "flap":  # flapping runs on through the phase
                    time.sleep(settle)  # failover, the rails dialed, lanes in place
            (tmp_path / f"go-{phase}").touch()
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    results = {}
    for role in ("send", "recv"):
        path = tmp_path / f"result-{role}.json"
        assert path.exists(), logs(tmp_path)
        results[role] = json.loads(path.read_text())
        assert results[role]["error"] is None, (results[role]["error"], logs(tmp_path))
    recv = results["recv"]
    assert recv["bad_count"] == 0, recv["bad"]
    return results


def logs(tmp_path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("log-*")))


def shares(phase) -> dict:
    sent = {nic: phase["nic_bytes_sent"].get(nic, 0) for nic in NICS}
    total = sum(sent.values())
    assert total > 0, phase
    return {nic: sent[nic] / total for nic in NICS}


def lanes(phase) -> list:
    return sorted(sorted(entry["nics"]) for entry in phase["spreading"])


def check_spread_phases(results) -> None:
    phases = {p["phase"]: p for p in results["send"]["phases"]}
    free = shares(phases["free"])
    assert all(0.2 <= free[nic] <= 0.3 for nic in NICS), free
    assert lanes(phases["free"]) == []

    one = shares(phases["down1"])
    assert one["eth0"] == 0, one
    # Each survivor carries its own channel and a third of eth0's: a third of all.
    assert all(0.25 <= one[nic] <= 0.45 for nic in NICS[1:]), one
    assert lanes(phases["down1"]) == [["eth1", "eth2", "eth3"]], phases["down1"]["spreading"]

    two = shares(phases["down2"])
    assert two["eth0"] == 0 and two["eth2"] == 0, two
    # Half each, give or take the scheduling noise of a loaded 2-core machine
    # (CI once saw 0.38/0.62): not spreading would leave one NIC near 0 or 1.
    assert all(0.35 <= two[nic] <= 0.65 for nic in ("eth1", "eth3")), two
    assert lanes(phases["down2"]) == [["eth1", "eth3"], ["eth1", "eth3"]], phases["down2"]["spreading"]

    healed = shares(phases["heal"])
    assert all(0.2 <= healed[nic] <= 0.3 for nic in NICS), healed
    assert lanes(phases["heal"]) == []
    kinds = [e["kind"] for e in results["send"]["events"]]
    assert kinds.count("failback") >= 2, kinds  # both spreading connections came back


def spread_faults():
    return {
        "free": None,
        "down1": lambda fab: fab.nic_down(0, 0),
        "down2": lambda fab: fab.nic_down(0, 2),
        "heal": lambda fab: fab.heal(),
        # eth1 (channel 1's primary, channel 0's backup) flaps through the phase.
        "flap": lambda fab: fab.flap(0, 1, period_s=0.2, count=15),
    }


@pytest.mark.timeout(240)
def test_plugin_spreads_over_surviving_nics_fails_back_and_survives_flapping(tmp_path):
    results = run_phases(tmp_path, "plugin", spread_faults())
    check_spread_phases(results)


@pytest.mark.timeout(240)
def test_transport_spreads_over_surviving_nics_fails_back_and_survives_flapping(tmp_path):
    results = run_phases(tmp_path, "transport", spread_faults())
    check_spread_phases(results)
