"""The NCCL net plugin ABI, driven as NCCL's proxy drives it (no NCCL needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import torch_reccl
from nccl_net_harness import (INVALID_ARGUMENT, PTR_CUDA, REMOTE_ERROR, SUCCESS, VERSIONS,
                              Plugin, message_sizes, receive_stream, send_stream)

HERE = os.path.dirname(__file__)
LOOPBACK = {"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_HEARTBEAT_MS": "300"}


@pytest.fixture(autouse=True)
def loopback_nics(monkeypatch):
    # The plugin reads its settings from the environment at init, as under NCCL.
    for name, value in LOOPBACK.items():
        monkeypatch.setenv(name, value)
    yield
    for nic in ("lo:127.0.0.1", "lo:127.0.0.2"):
        try:
            torch_reccl.inject_fault(nic, "up")
        except ValueError:
            pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", VERSIONS)
def test_exported_table_and_properties(version):
    plugin = Plugin(version)
    assert plugin.table.name == b"ReCCL"
    assert plugin.devices() == 2
    for dev in range(2):
        props = plugin.properties(dev)
        assert props.name.decode() == f"lo:127.0.0.{dev + 1}"
        assert props.ptrSupport == 1 and props.maxRecvs == 1 and props.speed > 0
        assert props.maxComms > 0 and props.netDeviceType == 0
        if version >= 10:
            assert props.vNdevs == 1 and props.vDevs[0] == dev
            assert props.maxP2pBytes == 1 << 30
        if version >= 12:
            assert props.railId == dev
    assert plugin.table.getProperties(5, None) != SUCCESS  # out of range, no crash


def run_pair(version: int, sizes, window: int = 8, fault=None):
    plugin = Plugin(version)
    handle, listen_comm = plugin.listen(0)
    errors, good = [], []
    send_comm_box = []

    def connect():
        send_comm_box.append(plugin.connect(0, handle))

    connector = threading.Thread(target=connect)
    connector.start()
    recv_comm = plugin.accept(listen_comm)  # setup thread and "proxy" run concurrently
    # NCCL closes the listen comm as soon as accept returns; the backup path and
    # every later re-dial must still be admitted.
    assert plugin.table.closeListen(listen_comm) == SUCCESS
    connector.join(timeout=30)
    send_comm = send_comm_box[0]
    deadline = time.monotonic() + 60

    def sender():
        try:
            send_stream(plugin, send_comm, sizes, 3, window, deadline)
        except Exception as error:
            errors.append(f"send: {error}")

    def receiver():
        try:
            good.append(receive_stream(plugin, recv_comm, sizes, 3, window, deadline))
        except Exception as error:
            errors.append(f"recv: {error}")

    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    if fault is not None:
        fault()
    for t in threads:
        t.join(timeout=70)
    assert not any(t.is_alive() for t in threads), "a proxy thread hung"
    for close, comm in ((plugin.table.closeSend, send_comm), (plugin.table.closeRecv, recv_comm)):
        assert close(comm) == SUCCESS
    return errors, good


@pytest.mark.timeout(90)
@pytest.mark.parametrize("version", VERSIONS)
def test_random_sizes_many_in_flight(version):
    sizes = message_sizes(version, 120, 4 << 20)
    errors, good = run_pair(version, sizes)
    assert errors == [] and good == [len(sizes)]


@pytest.mark.timeout(90)
def test_failover_under_the_plugin():
    events = []
    handle = torch_reccl.on_event(events.append, kinds=["failover"])
    sizes = message_sizes(11, 200, 4 << 20)

    def fault():
        time.sleep(0.2)
        torch_reccl.inject_fault("lo:127.0.0.1", "down")
        time.sleep(0.5)
        torch_reccl.inject_fault("lo:127.0.0.1", "up")

    errors, good = run_pair(11, sizes, fault=fault)
    torch_reccl.events.flush_events()
    handle.remove()
    assert errors == [] and good == [len(sizes)]
    assert events, "the fault went unnoticed"


@pytest.mark.timeout(30)
def test_usage_errors_are_reported_not_crashed():
    plugin = Plugin(11)
    handle, listen_comm = plugin.listen(0)
    box = []
    connector = threading.Thread(target=lambda: box.append(plugin.connect(0, handle)))
    connector.start()
    recv_comm = plugin.accept(listen_comm)
    connector.join(timeout=30)
    send_comm = box[0]
    small = np.zeros(16, np.uint8)
    # Device memory is not claimed, so registering it is refused.
    code, _ = plugin.reg_mr(recv_comm, small, PTR_CUDA)
    assert code != SUCCESS
    # Grouped receives beyond maxRecvs=1 are refused.
    code, _ = plugin.irecv(recv_comm, [small, small], None, check=False)
    assert code == INVALID_ARGUMENT
    # A send larger than the posted receive fails the send request.
    _, recv_request = plugin.irecv(recv_comm, [small], None)
    send_request = plugin.isend(send_comm, np.ones(64, np.uint8), None)
    deadline = time.monotonic() + 10
    while True:
        code, done, _ = plugin.test(send_request)
        if code != SUCCESS or done or time.monotonic() > deadline:
            break
    assert code == REMOTE_ERROR
    assert plugin.table.closeSend(send_comm) == SUCCESS
    assert plugin.table.closeRecv(recv_comm) == SUCCESS
    assert plugin.table.closeListen(listen_comm) == SUCCESS


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_cross_host_link_down(tmp_path):
    from torch_reccl.fabric import Fabric

    env = {**os.environ, "RECCL_NICS": "eth0,eth1", "RECCL_HEARTBEAT_MS": "300",
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with Fabric(hosts=2, rails=2, rate_mbit=800, name="np") as fab:
        procs = [fab.popen(host, [sys.executable, os.path.join(HERE, "nccl_net_harness.py"),
                                  "--role", role, "--dir", str(tmp_path)], env=env,
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"log-{role}", "w"))
                 for host, role in ((1, "recv"), (0, "send"))]
        deadline = time.monotonic() + 30
        while not (tmp_path / "progress-send").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        fab.nic_down(1, 0)  # the receiver's primary NIC loses its link
        for proc in procs:
            proc.wait(timeout=90)
    results = {}
    for role in ("send", "recv"):
        with open(tmp_path / f"result-{role}.json") as f:
            results[role] = json.load(f)
    assert results["send"]["error"] is None, results["send"]
    assert results["recv"]["error"] is None, results["recv"]
    assert results["recv"]["good"] == 150
    assert any(e["kind"] == "failover" for e in results["recv"]["events"] + results["send"]["events"])
