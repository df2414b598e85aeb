"""`reccl qualify`: the checks' own logic, and real runs of `--local 2` on loopback.

The runs start two ranks, each its own emulated host over the loopback NICs
127.0.0.1 and 127.0.0.2 (no root): a healthy run passes every check and writes the
JSON record and the Markdown report with every section; a RECCL_NICS entry that is
no local NIC fails the inventory, naming the entry, and nothing after it runs.
The emulated fabric's case (a rail whose link is down) is in
tests/fabric/test_qualify_fabric.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from torch_reccl.qualify import cli, inventory, reach, report

from conftest import A0, A1, B0, B1, REPO, heal_all, ib_env, native, testing as load_testing

# small and short: the point is that every check runs and its result is right
FAST = ["--sizes-mib", "1", "--perf-budget", "0.2", "--failover-mib", "1", "--failover-base", "1",
        "--failover-hold", "1.5", "--reach-timeout", "10"]


def qualify(*args, env=None, timeout=150) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "torch_reccl", "qualify", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def nic(rail, address, up=True, subnet=None, mtu=1500, speed=100000):
    return {"rail": rail, "name": f"eth{rail}", "interface": f"eth{rail}", "address": address, "up": up,
            "operstate": "up" if up else "down", "speed_mbps": speed, "mtu": mtu, "numa_node": 0,
            "pci_path": "", "subnet": subnet or address.rsplit(".", 1)[0] + ".0/24", "backup": None}


def host(name, nics, error=None):
    return {"hostname": name, "error": error, "nics": nics, "rdma": {"devices": []}, "gpu": {"gpus": []},
            "versions": {"torch_reccl": "0.1.0", "torch": "2", "nccl": None},
            "nccl_net_plugin": {"value": None, "ours": False}}


# --------------------------------------------------------------------------- logic


def test_inventory_flags_what_the_hosts_disagree_on():
    a = host("a", [nic(0, "10.0.0.1"), nic(1, "10.0.1.1")])
    b = host("b", [nic(0, "10.0.0.2"), nic(1, "10.0.2.2", mtu=9000)])
    c = host("c", [nic(0, "10.0.0.3", up=False)])
    problems, warnings, rails = inventory.compare([a, b, c])
    assert rails == 1
    assert any("different NIC counts: 2 (hosts 0, 1), 1 (host 2)" in p for p in problems), problems
    assert any(p.startswith("host 2 (c): rail 0 NIC eth0 (10.0.0.3) is down") for p in problems), problems
    problems, warnings, rails = inventory.compare([a, b])
    assert problems == [] and rails == 2
    assert any("rail 1: the hosts disagree on the subnet: 10.0.1.0/24 (host 0), 10.0.2.0/24 (host 1)" in w
               for w in warnings), warnings
    assert any("rail 1: the hosts disagree on the MTU: 1500 (host 0), 9000 (host 1)" in w for w in warnings)
    same = host("d", [nic(0, "10.0.0.1"), nic(1, "10.0.1.9")])
    assert any("hosts 0 and 1 both have address 10.0.0.1" in w for w in inventory.compare([a, same])[1])


def test_inventory_reports_a_host_that_could_not_list_its_nics():
    bad = host("b", [], error="RECCL_NICS entry 'eth9' matches no local IPv4 interface or address")
    problems, _, rails = inventory.compare([host("a", [nic(0, "10.0.0.1")]), bad])
    assert problems == ["host 1 (b): RECCL_NICS entry 'eth9' matches no local IPv4 interface or address"]
    assert rails == 1


def test_reach_checks_every_pair_up_to_16_hosts_then_ring_neighbours():
    assert reach.targets(2, 0) == [1]
    assert reach.targets(16, 3) == [h for h in range(16) if h != 3]
    assert reach.targets(17, 0) == [1, 16]
    assert reach.targets(100, 50) == [49, 51]
    # every dial is expected by its target: the plan is symmetric
    for hosts in (3, 16, 17, 40):
        for h in range(hosts):
            assert all(h in reach.targets(hosts, t) for t in reach.targets(hosts, h))


def test_bad_checks_are_refused_naming_the_valid_ones():
    assert cli.parse_checks("failover") == ["inventory", "failover"]
    with pytest.raises(argparse.ArgumentTypeError, match="valid: inventory, reach, perf, failover"):
        cli.parse_checks("reach,speed")


def test_tcp_probe_names_the_address_that_refuses():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import time

    out = reach.tcp_probes([("k", "127.0.0.2", "127.0.0.1", port)], time.monotonic() + 5)
    assert out["k"]["connected"] is False
    assert f"from 127.0.0.2 to 127.0.0.1:{port}: Connection refused" in out["k"]["error"]
    echo = reach.EchoServer(["127.0.0.1"])
    try:
        out = reach.tcp_probes([("k", "127.0.0.2", "127.0.0.1", echo.ports[0])], time.monotonic() + 5, rounds=3)
    finally:
        echo.close()
    assert out["k"]["connected"] and out["k"]["error"] is None and out["k"]["rtt_us"] > 0


@pytest.mark.parametrize("kind", ["tcp", "verbs"])
def test_dial_shakes_hands_on_each_rail_and_names_the_one_that_does_not(kind):
    """reach.dial between two hosts in one process, one transport per rail: over TCP
    (loopback NICs) and over reccl's IB transport on the verbs emulation, the path a
    cluster with RDMA devices takes. Host b's rail-1 device drops every packet (IB) /
    host b has no listener on rail 1 but a stale handle (TCP): rail 0 connects with a
    round-trip time, rail 1 fails by the deadline naming its path."""
    import threading
    import time

    if kind == "verbs":
        emu = load_testing().IbEmulation([A0, A1, B0, B1])
        devices = {"a": [A0, A1], "b": [B0, B1]}
        maker = {h: (lambda rail, h=h: native().IbTransport(emu, ib_env([devices[h][rail]])))
                 for h in ("a", "b")}
    else:
        emu = None
        addresses = {"a": ["127.0.0.1", "127.0.0.2"], "b": ["127.0.0.3", "127.0.0.4"]}
        maker = {h: reach.tcp_transport_maker(addresses[h]) for h in ("a", "b")}
    a, b = reach.RailListeners(maker["a"], 2), reach.RailListeners(maker["b"], 2)
    try:
        assert a.errors == [None, None] and b.errors == [None, None]
        handles = b.handles()
        if kind == "verbs":
            emu.drop(B1, True)
            expected = {0: 1, 1: 1}
        else:  # a handle whose listener is gone: the dial finds nobody there
            b.listeners[1].close()
            expected = {0: 1}
        deadline = time.monotonic() + 3.0
        accepted = threading.Thread(target=reach.dial, args=(b, [], expected, deadline), daemon=True)
        accepted.start()
        rows = reach.dial(a, [(1, 0, handles[0]), (1, 1, handles[1])], {}, deadline)
        accepted.join(15)
        assert not accepted.is_alive()
    finally:
        a.close()
        b.close()
        if emu is not None:
            emu.drop(B1, False)
        heal_all()
    assert rows[(1, 0)]["ok"] and rows[(1, 0)]["rtt_us"] > 0 and rows[(1, 0)]["error"] is None, rows
    assert not rows[(1, 1)]["ok"] and rows[(1, 1)]["rtt_us"] is None, rows
    assert "connect not complete" in rows[(1, 1)]["error"] and "paths: primary" in rows[(1, 1)]["error"], rows


def test_summary_lists_every_reason_a_run_failed():
    record = {"date": "d", "command": "reccl qualify", "world": 2, "rails": 2, "device": "cpu",
              "hosts": [{"index": 0, "hostname": "a", "ranks": [0]}, {"index": 1, "hostname": "b", "ranks": [1]}],
              "checks": {"inventory": {"status": "failed", "problems": ["host 1 (b): rail 1 NIC eth1 is down"],
                                       "warnings": [], "rails": 2, "hosts": []},
                         "reach": {"status": "skipped", "reason": "an earlier check failed", "problems": []}}}
    record["failures"] = report.failures(record)
    record["ok"] = False
    text = report.summary(record)
    assert "verdict: FAILED\n  - inventory: host 1 (b): rail 1 NIC eth1 is down" in text
    assert "reachability  skipped: an earlier check failed" in text
    assert "## Failures\n\n- inventory: host 1 (b): rail 1 NIC eth1 is down" in report.markdown(record)


# --------------------------------------------------------------------------- runs


@pytest.mark.timeout(180)
def test_local_2_on_loopback_passes_every_check_and_writes_json_and_report(tmp_path):
    out, md = tmp_path / "q.json", tmp_path / "q.md"
    done = qualify("--local", "2", *FAST, "--json", str(out), "--report", str(md))
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "verdict: PASSED" in done.stdout
    record = json.loads(out.read_text())
    checks = record["checks"]
    assert {name: c["status"] for name, c in checks.items()} == {
        "inventory": "passed", "reach": "passed", "perf": "passed", "failover": "passed"}, record["failures"]
    assert record["ok"] and record["world"] == 2 and record["rails"] == 2 and record["device"] == "cpu"
    assert [h["ranks"] for h in record["hosts"]] == [[0], [1]], "each rank its own host"
    nics = [n["name"] for n in checks["inventory"]["hosts"][1]["nics"]]
    assert nics == ["lo:127.0.0.1", "lo:127.0.0.2"]
    rows = checks["reach"]["rows"]
    assert sorted((r["src"], r["dst"], r["rail"]) for r in rows) == [(0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1)]
    assert all(r["tcp"]["connected"] and r["hello"]["ok"] and r["hello"]["rtt_us"] > 0 for r in rows), rows
    perf = checks["perf"]
    assert perf["baseline"] == "Gloo"
    assert [(r["op"], r["bytes"]) for r in perf["rows"]] == [("all_reduce", 1 << 20), ("all_gather", 1 << 20)]
    for row in perf["rows"]:
        for side in ("reccl", "baseline"):
            assert row[side]["wrong"] == 0 and row[side]["busbw_gbps"] > 0, row
    rails = checks["failover"]["rails"]
    assert [(r["rail"], r["nic"], r["host"]) for r in rails] == [(0, "lo:127.0.0.1", 0), (1, "lo:127.0.0.2", 1)]
    for r in rails:
        assert r["ops"] > 10 and r["kept"] > 0 and r["longest_down_ms"] > 0, r
        for rank in r["ranks"]:
            assert rank["wrong_ops"] == 0, r
            assert rank["failover"] >= 1 and rank["failback"] >= 1, f"rank {rank['rank']}: {rank['events']}"
    text = md.read_text()
    for section in ("# reccl qualify: PASSED", "## Inventory", "## Reachability", "## Performance", "## Failover"):
        assert section in text, section


@pytest.mark.timeout(120)
def test_a_nic_entry_that_is_no_local_nic_fails_naming_it(tmp_path):
    out, md = tmp_path / "q.json", tmp_path / "q.md"
    done = qualify("--local", "2", *FAST, "--json", str(out), "--report", str(md),
                   env={"RECCL_NICS": "127.0.0.1,eth9"})
    assert done.returncode == 1, done.stdout + done.stderr[-4000:]
    reason = "RECCL_NICS entry 'eth9' matches no local IPv4 interface or address; available: lo(127.0.0.1)"
    assert "  - inventory: host 0 (" in done.stdout and reason in done.stdout, done.stdout
    record = json.loads(out.read_text())
    statuses = {name: c["status"] for name, c in record["checks"].items()}
    assert statuses == {"inventory": "failed", "reach": "skipped", "perf": "skipped", "failover": "skipped"}
    assert record["checks"]["reach"]["reason"] == "a host could not list its NICs (inventory)"
    assert reason in md.read_text()
