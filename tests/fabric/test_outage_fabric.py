"""Total outages in the emulated fabric, with default timers.

Two emulated hosts with two rails each train a small model over the "reccl"
backend (torch_reccl/bench/fabric_train.py through torch_reccl/bench/outage_train.py). At step 20
a real outage starts and lasts 20 s: every NIC of host 1 loses its link, or the
two hosts lose different rails at once (host 0 rail 0, host 1 rail 1: no common
healthy rail). No path is left, so every connection stalls; once the links are
back, training must go on and end bit-identical to the fault-free run, with
`stalled` and `recovered` events and no `connection_failed`. A killed peer
process, by contrast, fails the surviving rank within a bound far below the
outage wait (measured in bench/dead_peer.py). Needs root (network namespaces).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from torch_reccl.fabric import Fabric

from conftest import REPO, RankProcesses

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

WORKER = [sys.executable, "-m", "torch_reccl.bench.outage_train"]
STEPS = 40
OUTAGE_S = 20.0
NAME = "ou"  # this module's fabric


def default_env() -> dict:
    """The environment with no RECCL_* setting but the NICs: the defaults under test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    env["RECCL_NICS"] = "eth0,eth1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def fabric():
    owner = Fabric.builder_pid(NAME)
    if not (owner and os.path.exists(f"/proc/{owner}")):
        Fabric.cleanup(NAME)  # left by a run that died; idempotent
    fab = Fabric(hosts=2, rails=2, rate_mbit=2000, name=NAME)
    fab.up()
    try:
        yield fab
    finally:
        fab.down()


class Training(RankProcesses):
    """A worker per host; rank 0 prints PAUSE at the given step and waits for "go"."""

    _port = 29700

    def __init__(self, fab: Fabric, pause=None, deadline: float = 80.0):
        Training._port += 1
        self.deadline = time.monotonic() + deadline
        argv = ["--world", str(fab.hosts), "--master", fab.mgmt_ip(0), "--port", str(Training._port),
                "--steps", str(STEPS)]
        if pause is not None:
            argv += ["--pause", str(pause)]
        self.procs = [fab.popen(h, [*WORKER, "--rank", str(h)] + argv, env=default_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
                      for h in range(fab.hosts)]

    def wait_pause(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.procs[0].stdout, selectors.EVENT_READ)
        if not sel.select(timeout=max(0.0, self.deadline - time.monotonic())):
            raise AssertionError(f"rank 0 did not pause in time\n{self.logs()}")
        line = self.procs[0].stdout.readline()
        assert line.startswith("PAUSE"), f"expected PAUSE, got {line!r}\n{self.logs()}"

    def go(self) -> None:
        self.procs[0].stdin.write("go\n")
        self.procs[0].stdin.flush()

    def results(self) -> list:
        out = []
        for rank, proc in enumerate(self.procs):
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} hung\n{self.logs()}")
            assert proc.returncode == 0, f"rank {rank} failed ({proc.returncode}):\n{stderr[-4000:]}"
            lines = stdout.strip().splitlines()
            result = json.loads(lines[-2])
            result.update(json.loads(lines[-1]))
            out.append(result)
        return out


@pytest.fixture(scope="module")
def reference(fabric):
    results = Training(fabric).results()
    assert results[0]["params"] == results[1]["params"]
    return results[0]


def outage(fabric, down: list, reference) -> list:
    """Trains with the NICs `down` ((host, rail) pairs) losing their links for
    OUTAGE_S from step 20; returns each rank's result."""
    run = Training(fabric, pause=20)
    try:
        run.wait_pause()
        for host, rail in down:
            fabric.nic_down(host, rail, wait=False)
        began = time.monotonic()
        run.go()
        time.sleep(OUTAGE_S)
        fabric.heal()
        healed_after = time.monotonic() - began
        results = run.results()
    finally:
        fabric.heal()
        run.kill()
    assert healed_after >= OUTAGE_S
    for r in results:
        assert r["params"] == reference["params"], "final parameters differ from the fault-free run"
        assert r["losses"] == reference["losses"], "loss curve differs from the fault-free run"
        kinds = [e["kind"] for e in r["events"]]
        assert "connection_failed" not in kinds, r["events"]
    return results


def check_stall_events(results) -> None:
    """Each rank saw a connection stall for most of the outage and recover."""
    for r in results:
        stalled = [e for e in r["events"] if e["kind"] == "stalled"]
        recovered = [e for e in r["events"] if e["kind"] == "recovered" and e["connection"]]
        assert stalled and recovered, r["events"]
        assert r["stalls"] >= 1
        # Reported at 1, 2, 4, 8 and 16 s of it: a handful per connection, never a flood.
        per_connection = {}
        for e in stalled:
            per_connection[e["connection"]] = per_connection.get(e["connection"], 0) + 1
        assert max(per_connection.values()) <= 6, per_connection
        assert "RECCL_NO_PATH_TIMEOUT_MS" in stalled[0]["detail"], stalled[0]
        longest = max(e["duration_s"] for e in recovered)
        assert OUTAGE_S - 5 <= longest <= OUTAGE_S + 30, recovered


@pytest.mark.timeout(150)
def test_host_loses_every_nic_for_20s(fabric, reference):
    results = outage(fabric, [(1, 0), (1, 1)], reference)
    check_stall_events(results)


@pytest.mark.timeout(150)
def test_no_common_rail_for_20s(fabric, reference):
    results = outage(fabric, [(0, 0), (1, 1)], reference)
    check_stall_events(results)


@pytest.mark.timeout(120)
def test_killed_peer_process_fails_the_other_rank_fast(fabric):
    """SIGKILL of host 1's rank mid-training: its host's kernel answers for it
    (end of stream, connection refused), so rank 0 fails after
    RECCL_PEER_GONE_TIMEOUT_MS (10 s), far from the 120 s outage wait. The
    bound here is generous for a loaded CI box; bench/dead_peer.py measures it."""
    run = Training(fabric, pause=20)
    try:
        run.wait_pause()
        run.procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        run.go()
        try:
            _, stderr = run.procs[0].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank 0 still running 60 s after its peer was killed\n{run.logs()}")
        took = time.monotonic() - killed
    finally:
        run.kill()
    assert run.procs[0].returncode != 0
    assert "RECCL_PEER_GONE_TIMEOUT_MS" in stderr or "closed the connection" in stderr, stderr[-3000:]
    assert took < 45, f"rank 0 failed {took:.1f} s after the kill"
