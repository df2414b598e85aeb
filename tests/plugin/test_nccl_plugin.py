"""The NCCL net plugin ABI, driven as NCCL's proxy drives it (no NCCL needed).

Over TCP (loopback addresses and emulated hosts) in this process, and over the IB
verbs transport on the in-process verbs emulation, one fresh process per scenario
(the plugin picks its transport once per process, at init, as under NCCL).
"""
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
from torch_reccl._native import testing as emulations
from torch_reccl.bench.nccl_net import (
    INTERNAL_ERROR,
    INVALID_ARGUMENT,
    PTR_CUDA,
    PTR_DMABUF,
    PTR_HOST,
    REMOTE_ERROR,
    SUCCESS,
    VERSIONS,
    Plugin,
    message_sizes,
    run_pair,
)
from torch_reccl.transport import _C, RecclError

from conftest import HELPERS, REPO
from nccl_net_harness import IB_DEVICES, DmaBufArena, ib_emulation_env

# TCP named explicitly: on a host with RDMA devices auto would pick IB.
LOOPBACK = {"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_HEARTBEAT_MS": "300", "RECCL_TRANSPORT": "tcp"}


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


@pytest.mark.timeout(30)
def test_dmabuf_registration_over_tcp_is_a_clear_error():
    plugin = Plugin(11)
    assert all(not plugin.properties(dev).ptrSupport & PTR_DMABUF for dev in range(2))
    arena = DmaBufArena(1 << 16, "reccl-tcp")
    code, _ = plugin.reg_mr_dmabuf(None, arena.device, arena.size, arena.fd)
    assert code == INTERNAL_ERROR
    assert any("regMrDmaBuf: dma-buf registration is not supported: tcp transport does not "
               "register dma-buf memory" in m for m in plugin.messages), plugin.messages
    # Host memory registers (nothing to register on TCP) and still streams.
    host = np.zeros(64, np.uint8)
    code, mhandle = plugin.reg_mr(None, host)
    assert code == SUCCESS and mhandle.value
    assert plugin.table.deregMr(None, mhandle) == SUCCESS


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
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with Fabric(hosts=2, rails=2, rate_mbit=800, name="np") as fab:
        procs = [fab.popen(host, [sys.executable, "-m", "torch_reccl.bench.nccl_net",
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


# --------------------------------------------------------- over the IB emulation


def run_ib_case(tmp_path, name, timeout=150, **env_changes):
    """Runs one scenario of nccl_net_harness.py in a fresh process; returns its report."""
    env = {**os.environ, **ib_emulation_env(),
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    env.update(env_changes)
    proc = subprocess.run([sys.executable, os.path.join(HELPERS, "nccl_net_harness.py"),
                           "--ib-case", name, "--dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    report_path = tmp_path / f"ib-{name}.json"
    assert report_path.exists(), f"no report (rc {proc.returncode}): {proc.stderr[-3000:]}"
    with open(report_path) as f:
        report = json.load(f)
    assert report["error"] is None, f"{report['error']}\n{proc.stderr[-3000:]}"
    return report


@pytest.mark.timeout(160)
def test_ib_properties_are_truthful(tmp_path):
    report = run_ib_case(tmp_path, "properties")
    assert report["transport"] == "ib"
    assert report["health"] == {IB_DEVICES[0]: True, IB_DEVICES[1]: True}
    assert any(f"over ib using {IB_DEVICES[0]}(bootstrap 127.0.0.1, backup {IB_DEVICES[1]})" in m
               for m in report["messages"]), report["messages"]
    assert report["out_of_range"] != SUCCESS
    for version, devices in report["versions"].items():
        version = int(version)
        assert [d["name"] for d in devices] == list(IB_DEVICES)
        for dev, props in enumerate(devices):
            # The emulation registers dma-buf fds: host, CUDA and dma-buf
            # pointers (GPUDirect), nothing forced to flush, one receive per irecv.
            assert props["ptrSupport"] == PTR_HOST | PTR_CUDA | PTR_DMABUF
            assert props["regIsGlobal"] == 0
            assert props["maxRecvs"] == 1 and props["netDeviceType"] == 0
            # The emulated port reports 4x EDR; emulated devices have no sysfs entry.
            assert props["speed"] == 100000 and props["pciPath"] is None
            if version >= 10:
                assert props["vDevs"] == [dev] and props["maxP2pBytes"] == 1 << 30
                assert props["forceFlush"] == 0
            if version >= 11:
                assert props["maxMultiRequestSize"] == 1
            if version >= 12:
                assert props["railId"] == dev


@pytest.mark.timeout(200)
def test_ib_random_sizes_many_in_flight_every_version(tmp_path):
    report = run_ib_case(tmp_path, "streams", timeout=190)
    assert report["transport"] == "ib"
    for version, run in report["versions"].items():
        assert run["errors"] == [] and run["good"] == [run["count"]], (version, run)
        # The bytes went through the emulated RC QPs as RDMA writes, nothing failed.
        assert run["bytes"] >= run["payload"] and run["writes"] >= run["count"], (version, run)
        assert run["retry_exceeded"] == 0 and run["access_errors"] == 0, (version, run)


@pytest.mark.timeout(120)
def test_ib_registered_host_buffers_are_placed_without_staging_through_a_port_down(tmp_path):
    report = run_ib_case(tmp_path, "registered")
    assert report["reg_codes"] == [SUCCESS, SUCCESS]
    assert report["errors"] == [] and report["bad"] == [], report
    assert 60 <= report["at_port_down"] < 150 <= report["at_port_up"] < report["count"], report
    assert report["qp_errors"] > 0
    assert report["refused_code"] == SUCCESS and report["refused_handle"]
    assert report["flush_reads"] == 0  # host memory: iflush has nothing to do
    assert any("regMr: host buffer not registered, it will be staged: cannot register an empty "
               "buffer" in m for m in report["messages"]), report["messages"]
    # Only the empty message (nothing to register) took a staging slot.
    assert report["staged"] == report["empty"], report
    assert report["bytes"] >= report["payload"] and report["access_errors"] == 0


@pytest.mark.timeout(120)
def test_ib_dmabuf_buffers_are_placed_directly_through_a_port_down(tmp_path):
    report = run_ib_case(tmp_path, "dmabuf")
    for props in report["properties"]:
        assert props["ptrSupport"] == PTR_HOST | PTR_CUDA | PTR_DMABUF
    assert report["reg_codes"] == [SUCCESS, SUCCESS]
    # A GPU pointer without its dma-buf: no peer memory in the emulation.
    assert report["peer_code"] == INTERNAL_ERROR
    assert any("GPU buffer without dma-buf: the emulation has no peer-memory module" in m
               for m in report["messages"]), report["messages"]
    assert report["errors"] == [] and report["bad"] == [], report
    # The port went down mid-stream and came back before the end.
    assert 60 <= report["at_port_down"] < 150 <= report["at_port_up"] < report["count"], report
    assert report["qp_errors"] > 0
    # dma-buf memory cannot be staged: every non-empty message was placed, on
    # the primary and on the backup (the rkey of the receiver's backup device).
    assert report["staged"] == report["empty"] and report["access_errors"] == 0, report
    # iflush read one byte of every non-empty GPU receive through a loopback QP.
    assert report["flush_reads"] == report["count"] - report["empty"], report


@pytest.mark.timeout(60)
def test_ib_claims_gpu_memory_only_where_it_can_be_registered(tmp_path):
    """NCCL_PTR_CUDA only where a NIC can really register GPU memory: by dma-buf
    (the NICs' library and the GPUs both support it) or by pointer (a peer-memory
    module is loaded); otherwise NCCL stages GPU buffers through host memory.
    Before, dma-buf support of the NICs alone claimed both."""
    report = run_ib_case(tmp_path, "no_gpudirect")
    assert all(p["ptrSupport"] == PTR_HOST for p in report["properties"]), report["properties"]
    assert report["code"] == INTERNAL_ERROR and report["cuda_code"] == INTERNAL_ERROR
    assert any("no dma-buf GPUDirect: the GPUs cannot export dma-bufs: the emulated CUDA devices" in m
               for m in report["messages"]), report["messages"]
    assert any("regMr: memory type 2 is not supported; valid: host (GPU buffers need RECCL_NVL); no "
               "GPUDirect: the GPUs cannot export dma-bufs" in m and "peer-memory module" in m
               for m in report["messages"]), report["messages"]
    report = run_ib_case(tmp_path, "peer_memory_only")
    assert all(p["ptrSupport"] == PTR_HOST | PTR_CUDA for p in report["properties"]), report["properties"]
    assert any("GPUDirect RDMA by GPU pointer (peer memory)" in m for m in report["messages"])


def test_ib_without_zero_copy_claims_no_dmabuf(tmp_path):
    report = run_ib_case(tmp_path, "dmabuf_refused", RECCL_IB_ZERO_COPY="off")
    assert all(p["ptrSupport"] == PTR_HOST for p in report["properties"])
    assert report["code"] == INTERNAL_ERROR
    assert any("dma-buf registration is not supported: RECCL_IB_ZERO_COPY=off" in m
               for m in report["messages"]), report["messages"]


@pytest.mark.timeout(160)
def test_ib_port_down_mid_stream_fails_over_and_back_without_loss(tmp_path):
    report = run_ib_case(tmp_path, "failover")
    assert report["transport"] == "ib"
    assert report["errors"] == [] and report["good"] == [report["count"]]
    # Each message arrived once, intact (receive_stream compares every byte).
    assert sorted(report["order"]) == list(range(report["count"]))
    # The port went down mid-stream, not before or after it, and came back while
    # messages were still to come.
    assert 40 <= report["received_at_port_down"] < 100 <= report["received_at_port_up"] < report["count"]
    failovers = [e for e in report["events"] if e["kind"] == "failover"]
    assert failovers, report["events"]
    assert {e["nic"] for e in failovers} == {IB_DEVICES[0]}, failovers
    assert all(e["reason"] == "link down" for e in failovers), failovers
    assert all(e["from_path"] == 0 and e["to_path"] == 1 for e in failovers), failovers
    # Both ends returned to the primary device once its re-dialed QP was proven,
    # and the stream went on there.
    failbacks = [e for e in report["events"] if e["kind"] == "failback"]
    assert len(failbacks) == 2 and all(e["from_path"] == 1 and e["to_path"] == 0 for e in failbacks)
    assert report["received_at_failback"] < report["count"]
    # The failed QPs were fenced (moved to ERR, their requests flushed).
    before, after = report["counters_before"], report["counters_after"]
    assert after["qp_errors"] > before["qp_errors"]


@pytest.mark.timeout(60)
def test_ib_requested_on_a_host_without_rdma_devices_is_a_clear_error(tmp_path):
    if _C.ib_load_system_verbs()["devices"]:
        pytest.skip("this host has RDMA devices")
    report = run_ib_case(tmp_path, "no_devices", timeout=50)
    assert report["init_code"] == INTERNAL_ERROR and report["transport"] == ""
    text = "\n".join(report["messages"])
    assert "ReCCL plugin disabled: RECCL_TRANSPORT=ib, but" in text, text
    assert "lists no RDMA devices" in text or "verbs library is unusable" in text, text


@pytest.mark.timeout(30)
def test_verbs_hook_after_init_is_refused():
    plugin = Plugin(11)
    assert _C.nccl_plugin_transport() == "tcp"
    emu = emulations().IbEmulation(["hook-late-0"])
    with pytest.raises(RecclError, match="already runs over tcp"):
        emulations().nccl_plugin_use_verbs(emu)
    assert plugin.devices() == 2
