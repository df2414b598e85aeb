"""Failover under real faults in the emulated rail-optimized fabric.

Each scenario starts one peer process per emulated host (tests/helpers/fabric_peer.py):
every host streams random messages to every other host while a real fault hits
the fabric (a veth losing carrier, a bridge going down, packets silently
dropped); every message must arrive complete, in order and bit-exact, and the
right events must be emitted. Needs root (network namespaces).
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from torch_reccl.fabric import Fabric

from conftest import HELPERS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

PEER = os.path.join(HELPERS, "fabric_peer.py")
BASE_ENV = {"RECCL_HEARTBEAT_MS": "300", "RECCL_CONNECT_TIMEOUT_MS": "1000"}


class Scenario:
    def __init__(self, fab: Fabric, tmp_path, messages=60, max_bytes=16 << 20, env=None,
                 deadline=60.0):
        self.fab = fab
        self.dir = str(tmp_path)
        self.env = {**os.environ, **BASE_ENV, **(env or {})}
        self.procs = [
            fab.popen(host, [sys.executable, PEER, "--host", str(host), "--hosts", str(fab.hosts),
                             "--rails", str(fab.rails), "--dir", self.dir,
                             "--messages", str(messages), "--max-bytes", str(max_bytes),
                             "--deadline", str(deadline)],
                      env=self.env, stdout=open(os.path.join(self.dir, f"log-{host}"), "w"),
                      stderr=__import__("subprocess").STDOUT)
            for host in range(fab.hosts)
        ]
        self.deadline = time.monotonic() + deadline + 20

    def progress(self, host: int) -> dict:
        try:
            with open(os.path.join(self.dir, f"progress-{host}")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"sent": 0, "received": 0}

    def wait_progress(self, fraction: float, total_per_host: int) -> None:
        """Returns once every host has received `fraction` of what it expects."""
        want = fraction * total_per_host
        while time.monotonic() < self.deadline:
            if all(self.progress(h)["received"] >= want for h in range(self.fab.hosts)):
                return
            if any(p.poll() is not None for p in self.procs):
                return
            time.sleep(0.01)
        raise AssertionError(f"no progress to {fraction:.0%}: {self.logs()}")

    def mark_fault(self) -> None:
        """Tells the peers that the fault starts now (call just before applying it)."""
        open(os.path.join(self.dir, "fault"), "w").close()

    def logs(self) -> str:
        out = []
        for host in range(self.fab.hosts):
            with open(os.path.join(self.dir, f"log-{host}")) as f:
                out.append(f"--- host {host}\n{f.read()[-3000:]}")
        return "\n".join(out)

    def results(self) -> list:
        for proc in self.procs:
            try:
                proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except Exception:
                proc.kill()
                raise AssertionError(f"peer hung past the deadline\n{self.logs()}")
        results = []
        for host in range(self.fab.hosts):
            path = os.path.join(self.dir, f"result-{host}.json")
            assert os.path.exists(path), f"host {host} wrote no result\n{self.logs()}"
            with open(path) as f:
                results.append(json.load(f))
        return results


def assert_all_delivered(results, hosts: int, messages: int, logs: str) -> None:
    for result in results:
        assert result["errors"] == [], f"host {result['host']}: {result['errors']}\n{logs}"
        assert len(result["received"]) == hosts - 1
        assert all(count == messages for count in result["received"].values()), result["received"]


def paths_after_fault(results) -> set:
    """Active paths of the sending streams that ran on after the fault took
    effect: each stream's path at its last completion, counted when that came
    after the host's last failover of a sending connection (a stream that ended
    between the fault and its detection never needed the backup)."""
    paths = set()
    for result in results:
        switches = [e["time"] for e in result["events"]
                    if e["kind"] == "failover" and e["detail"].startswith("sender")]
        took_effect = max(switches, default=0.0)
        paths |= {path for path, seen in result["send_paths_after_fault"].values() if seen > took_effect}
    assert paths, "no stream was still running after the failover"
    return paths


def kinds(result) -> list:
    return [e["kind"] for e in result["events"]]


@pytest.fixture
def fabric(request):
    params = getattr(request, "param", {})
    fab = Fabric(hosts=params.get("hosts", 2), rails=params.get("rails", 2),
                 rate_mbit=params.get("rate_mbit", 800), name=params.get("name", "ft"))
    fab.up()
    try:
        yield fab
    finally:
        fab.down()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fabric", [{"hosts": 4, "rails": 3, "name": "ff4"}], indirect=True)
def test_fault_free_four_hosts(fabric, tmp_path):
    # Default-like timers: four busy hosts on two CPU cores must not look faulty.
    scenario = Scenario(fabric, tmp_path, messages=30, max_bytes=8 << 20,
                        env={"RECCL_HEARTBEAT_MS": "1000", "RECCL_CONNECT_TIMEOUT_MS": "5000"})
    results = scenario.results()
    assert_all_delivered(results, 4, 30, scenario.logs())
    for result in results:
        assert not {"failover", "path_down"} & set(kinds(result)), result["events"]
        assert set(result["send_active_paths"].values()) == {0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["host0", "both"])
def test_nic_down_mid_stream(fabric, tmp_path, which):
    """Host 0's primary NIC (or both hosts') loses carrier while messages are in
    flight both ways: host 0 is sender on one connection and receiver on the other."""
    scenario = Scenario(fabric, tmp_path, env={"RECCL_FAILBACK": "0"})
    scenario.wait_progress(0.3, 60)
    scenario.mark_fault()
    fabric.nic_down(0, 0)
    if which == "both":
        fabric.nic_down(1, 0)
    results = scenario.results()
    assert_all_delivered(results, 2, 60, scenario.logs())
    host0 = results[0]
    assert "nic_down" in kinds(host0)
    failovers = [e for e in host0["events"] if e["kind"] == "failover"]
    assert any(e["detail"].startswith("sender") and e["reason"] == "link down" for e in failovers), failovers
    assert all(e["duration_s"] is None or e["duration_s"] < 1.0 for e in failovers)
    # The peer learns of the fault over the backup, long before its heartbeat would.
    assert any(e["kind"] == "failover" for e in results[1]["events"]), results[1]["events"]
    assert paths_after_fault(results) == {1}
    assert host0["stats"]["nics"]["eth0"]["failovers"] >= 1


@pytest.mark.timeout(120)
def test_nic_down_right_after_the_first_message(fabric, tmp_path):
    """Host 0's primary NIC loses carrier as soon as every host has received its
    first message: the backups dialed at set-up (a control and one data socket;
    the other data sockets join when bulk data waits) carry the rest, bit-exact."""
    scenario = Scenario(fabric, tmp_path, env={"RECCL_FAILBACK": "0"})
    scenario.wait_progress(1 / 60, 60)
    scenario.mark_fault()
    fabric.nic_down(0, 0)
    results = scenario.results()
    assert_all_delivered(results, 2, 60, scenario.logs())
    assert "nic_down" in kinds(results[0])
    assert paths_after_fault(results) == {1}


@pytest.mark.timeout(120)
def test_link_down_during_setup_then_failback(fabric, tmp_path):
    fabric.nic_down(1, 0)
    scenario = Scenario(fabric, tmp_path)
    scenario.wait_progress(0.3, 60)
    fabric.nic_up(1, 0)
    results = scenario.results()
    assert_all_delivered(results, 2, 60, scenario.logs())
    # Connections formed over the backup and returned to the primary once it healed.
    assert any(e["kind"] == "failback" for r in results for e in r["events"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fabric", [{"rails": 3, "name": "f3"}], indirect=True)
def test_second_fault_during_resync(fabric, tmp_path):
    """The backup dies right after the primary: the connection moves on to the
    last-resort rail and still loses nothing."""
    scenario = Scenario(fabric, tmp_path, env={"RECCL_FAILBACK": "0"})
    scenario.wait_progress(0.3, 60)
    scenario.mark_fault()
    fabric.nic_down(0, 0, wait=False)
    time.sleep(0.005)
    fabric.nic_down(0, 1, wait=False)
    results = scenario.results()
    assert_all_delivered(results, 2, 60, scenario.logs())
    assert paths_after_fault(results) == {2}, [r["paths"] for r in results]


@pytest.mark.timeout(120)
def test_flapping_link(fabric, tmp_path):
    scenario = Scenario(fabric, tmp_path, messages=80)
    scenario.wait_progress(0.2, 80)
    flap = fabric.flap(0, 0, period_s=0.2, count=10)
    assert flap.join(timeout=10)
    results = scenario.results()
    assert_all_delivered(results, 2, 80, scenario.logs())
    downs = [e for e in results[0]["events"] if e["kind"] == "nic_down"]
    assert len(downs) >= 2, results[0]["events"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fabric", [{"hosts": 4, "rails": 2, "name": "rl4"}], indirect=True)
def test_rail_switch_down(fabric, tmp_path):
    scenario = Scenario(fabric, tmp_path, messages=30, max_bytes=8 << 20, env={"RECCL_FAILBACK": "0"})
    scenario.wait_progress(0.3, 3 * 30)
    scenario.mark_fault()
    fabric.rail_down(0)
    results = scenario.results()
    assert_all_delivered(results, 4, 30, scenario.logs())
    for result in results:
        assert "nic_down" in kinds(result)
    assert paths_after_fault(results) == {1}


@pytest.mark.timeout(120)
@pytest.mark.needs_nft
def test_blackhole_detected_by_heartbeat(fabric, tmp_path):
    scenario = Scenario(fabric, tmp_path, env={"RECCL_FAILBACK": "0"})
    scenario.wait_progress(0.3, 60)
    fabric.blackhole(0, 0, True)
    results = scenario.results()
    assert_all_delivered(results, 2, 60, scenario.logs())
    timeouts = [e for r in results for e in r["events"]
                if e["kind"] == "path_down" and e["reason"] == "timeout"]
    assert timeouts, [r["events"] for r in results]
    assert not any(e["kind"] == "nic_down" for r in results for e in r["events"])


@pytest.mark.timeout(120)
def test_all_paths_dead_fails_clearly(fabric, tmp_path):
    bound_ms = 1500
    scenario = Scenario(fabric, tmp_path, env={"RECCL_NO_PATH_TIMEOUT_MS": str(bound_ms)},
                        deadline=40)
    scenario.wait_progress(0.3, 60)
    fabric.nic_down(0, 0)
    fabric.nic_down(0, 1)
    killed_at = time.monotonic()
    results = scenario.results()
    for result in results:
        assert result["errors"], "a transfer succeeded with no path left"
        assert any("RECCL_NO_PATH_TIMEOUT_MS" in e for e in result["errors"]), result["errors"]
        # Failed within the bound (plus the time to notice), not at the peer deadline.
        assert result["elapsed_s"] < 40
    assert time.monotonic() - killed_at < bound_ms / 1000 + 15
    assert any(e["kind"] == "connection_failed" for r in results for e in r["events"])
