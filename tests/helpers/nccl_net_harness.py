"""The NCCL net plugin's test scenarios over the verbs emulation, and what the IB
tests share: registered-memory streams (raw_stream), dma-buf arenas standing in for
GPU buffers (DmaBufArena), port flaps, the emulation's settings.

The plugin driver itself (Plugin, the streams, run_pair) is torch_reccl.bench.nccl_net.
As a script it runs one whole scenario (--ib-case) in a fresh process, since the
plugin chooses its transport once per process (see test_nccl_plugin.py):

    python tests/helpers/nccl_net_harness.py --ib-case NAME --dir DIR
"""
from __future__ import annotations

import argparse
import ctypes as C
import json
import mmap
import os
import sys
import threading
import time

import numpy as np

from torch_reccl.bench.nccl_net import (
    PTR_CUDA,
    VERSIONS,
    Plugin,
    connect_pair,
    message,
    message_sizes,
    pump_requests,
    run_pair,
)


def raw_stream(plugin: Plugin, send_comm, recv_comm, plan, send_mhandle, recv_mhandle,
               window: int = 8, fault=None, progress: list | None = None, timeout: float = 60):
    """Streams `plan` [(send address, receive address, size)] from registered
    memory as NCCL's proxy threads would, flushing each receive (iflush) when it
    completes (the caller checks the bytes, which may live where the CPU cannot
    read them); `fault()` runs meanwhile. Returns errors."""
    deadline = time.monotonic() + timeout
    errors = []

    def done(what, index, size):
        if size != plan[index][2]:
            raise AssertionError(f"{what} {index}: {size} bytes, expected {plan[index][2]}")
        if what == "recv":
            code, request = plugin.iflush(recv_comm, [(plan[index][1], size)], recv_mhandle)
            plugin.check(code, f"iflush({index})")
            if request.value:  # done at once: the flush read completed inside iflush
                raise AssertionError(f"iflush({index}) returned a request")
        if progress is not None and what == "recv":
            progress.append(index)

    def run(what, post):
        try:
            pump_requests(plugin, what, len(plan), lambda i: post(plan[i]),
                          lambda index, size: done(what, index, size), window, deadline)
        except Exception as error:  # reported, not raised: the other side must finish too
            errors.append(f"{what}: {error}")

    threads = [
        threading.Thread(target=run, args=("send", lambda p: plugin.isend_raw(send_comm, p[0], p[2], send_mhandle))),
        threading.Thread(target=run, args=("recv",
                                           lambda p: plugin.irecv_raw(recv_comm, [(p[1], p[2])], recv_mhandle)[1])),
    ]
    for t in threads:
        t.start()
    if fault is not None:
        fault()
    for t in threads:
        t.join(timeout=timeout + 10)
    assert not any(t.is_alive() for t in threads), "a proxy thread hung"
    return errors


_libc = C.CDLL(None, use_errno=True)
_libc.mmap.restype = C.c_void_p
_libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]


class DmaBufArena:
    """A memfd standing in for a GPU buffer's dma-buf: `host` is the test's own
    mapping of it (to fill and check), `device` an address reserved with no
    access at all, standing for the GPU pointer NCCL passes. Any CPU access
    through `device` would crash the process: the bytes can only move through
    the (emulated) NIC's own mapping of the fd."""

    def __init__(self, size: int, name: str):
        self.size = max(size, 1)
        self.fd = os.memfd_create(name)
        os.ftruncate(self.fd, self.size)
        self._map = mmap.mmap(self.fd, self.size)
        self.host = np.frombuffer(self._map, dtype=np.uint8)
        prot_none, map_private, map_anonymous, map_noreserve = 0, 0x2, 0x20, 0x4000
        self.device = _libc.mmap(None, self.size, prot_none, map_private | map_anonymous | map_noreserve, -1, 0)
        assert self.device not in (None, C.c_void_p(-1).value), "reserving an address range failed"


def wait_received(progress: list, count: int, timeout: float = 30) -> None:
    """Waits (bounded) until `progress` lists `count` received messages."""
    deadline = time.monotonic() + timeout
    while len(progress) < count and time.monotonic() < deadline:
        time.sleep(0.001)


def flap_primary(emu, progress: list, down_at: int, up_at: int, log: dict):
    """A fault for raw_stream: the primary device's port goes down once `down_at`
    messages arrived and comes back at `up_at`; `log` records when."""
    def fault():
        wait_received(progress, down_at)
        log["at_port_down"] = len(progress)
        emu.port_down(IB_DEVICES[0])
        wait_received(progress, up_at)
        log["at_port_up"] = len(progress)
        emu.port_up(IB_DEVICES[0])
    return fault


def message_plan(sizes):
    """Message i's offset in one arena holding the whole plan."""
    return [int(o) for o in np.concatenate([[0], np.cumsum(sizes)[:-1]])]


# ------------------------------------------------------------ over the IB emulation

IB_DEVICES = ("emu_ib0", "emu_ib1")


def ib_emulation_env() -> dict:
    """What a plugin run over the verbs emulation reads at init (as under NCCL)."""
    return {
        "RECCL_TRANSPORT": "ib",
        "RECCL_IB_HCA": ",".join(IB_DEVICES),
        "RECCL_IB_BOOTSTRAP": "127.0.0.1",
        "RECCL_HEARTBEAT_MS": "300",
        "RECCL_CONNECT_TIMEOUT_MS": "2000",
        "RECCL_NO_PATH_TIMEOUT_MS": "10000",
        "RECCL_CHUNK_BYTES": str(256 << 10),
        # 4.096 us * 2^12 = 16.8 ms per try, 8 tries: retry-exceeded after ~134 ms.
        "RECCL_IB_TIMEOUT": "12",
        "RECCL_IB_RETRY_CNT": "7",
    }


def _plugin_properties(plugin: Plugin) -> list:
    out = []
    for dev in range(plugin.devices()):
        p = plugin.properties(dev)
        d = {"name": p.name.decode(), "pciPath": p.pciPath and p.pciPath.decode(),
             "speed": p.speed, "ptrSupport": p.ptrSupport, "maxRecvs": p.maxRecvs,
             "maxComms": p.maxComms, "netDeviceType": p.netDeviceType, "regIsGlobal": p.regIsGlobal}
        if plugin.version >= 10:
            d["vDevs"] = list(p.vDevs[:p.vNdevs])
            d["maxP2pBytes"] = p.maxP2pBytes
            d["forceFlush"] = p.forceFlush
        if plugin.version >= 11:
            d["maxMultiRequestSize"] = p.maxMultiRequestSize
        if plugin.version >= 12:
            d["railId"] = p.railId
        out.append(d)
    return out


def ib_case_properties(emu, native) -> dict:
    """Every table's devices and properties over the emulation."""
    result = {"versions": {}}
    for version in VERSIONS:
        plugin = Plugin(version)
        result["versions"][version] = _plugin_properties(plugin)
        result["out_of_range"] = plugin.table.getProperties(len(IB_DEVICES), None)
        result.setdefault("messages", []).extend(plugin.messages)
    result["transport"] = native.nccl_plugin_transport()
    result["health"] = {name: s["up"] for name, s in native.nic_stats().items()}
    return result


def ib_case_streams(emu, native) -> dict:
    """Random sizes, many requests in flight, every byte checked, per table version."""
    result = {"versions": {}, "transport": None}
    for version in VERSIONS:
        sizes = message_sizes(version, 120, 4 << 20)
        before = emu.counters()
        errors, good = run_pair(version, sizes)
        after = emu.counters()
        result["transport"] = native.nccl_plugin_transport()
        result["versions"][version] = {
            "errors": errors, "good": good, "count": len(sizes), "payload": sum(sizes),
            "writes": after["writes"] - before["writes"], "bytes": after["bytes"] - before["bytes"],
            "retry_exceeded": after["retry_exceeded"] - before["retry_exceeded"],
            "access_errors": after["access_errors"] - before["access_errors"]}
    return result


def ib_case_failover(emu, native) -> dict:
    """The primary device's port goes down mid-stream (PORT_ERR) and comes back
    (PORT_ACTIVE, new GID layout) while the stream still runs."""
    import torch_reccl

    events = []
    handle = torch_reccl.on_event(lambda e: events.append(e.to_dict()), kinds=["failover", "failback"])
    sizes = message_sizes(11, 600, 4 << 20)
    progress, fault_log = [], {}

    def fault():
        wait_received(progress, 40)
        fault_log["received_at_port_down"] = len(progress)
        fault_log["counters_before"] = emu.counters()
        emu.port_down(IB_DEVICES[0])
        wait_received(progress, 100)
        fault_log["received_at_port_up"] = len(progress)
        emu.port_up(IB_DEVICES[0])
        # Both ends fail back once the re-dialed primary QP is proven.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(progress) < len(sizes):
            torch_reccl.events.flush_events()
            if sum(e["kind"] == "failback" for e in events) >= 2:
                fault_log["received_at_failback"] = len(progress)
                break
            time.sleep(0.005)

    errors, good = run_pair(11, sizes, fault=fault, progress=progress)
    torch_reccl.events.flush_events()
    handle.remove()
    return {"transport": native.nccl_plugin_transport(), "errors": errors, "good": good,
            "count": len(sizes), "order": progress, "events": events,
            "counters_before": fault_log.pop("counters_before", None),
            "counters_after": emu.counters(), **fault_log}


def ib_case_registered(emu, native) -> dict:
    """Host buffers registered with regMr (one arena per side, as NCCL registers
    its buffers): placed directly, no staging, through a port down and back;
    every byte checked."""
    plugin = Plugin(11)
    send_comm, recv_comm = connect_pair(plugin)
    sizes = message_sizes(21, 300, 1 << 20)
    offsets = message_plan(sizes)
    src = np.zeros(max(sum(sizes), 1), np.uint8)
    dst = np.full_like(src, 0xA5)
    for i, size in enumerate(sizes):
        src[offsets[i]:offsets[i] + size] = message(21, i, size)
    (code_s, send_mh), (code_r, recv_mh) = plugin.reg_mr(send_comm, src), plugin.reg_mr(recv_comm, dst)
    plan = [(src.ctypes.data + o, dst.ctypes.data + o, s) for o, s in zip(offsets, sizes)]
    progress, log = [], {}
    before = emu.counters()
    errors = raw_stream(plugin, send_comm, recv_comm, plan, send_mh, recv_mh,
                        fault=flap_primary(emu, progress, 60, 150, log), progress=progress)
    after = emu.counters()
    bad = [i for i, (o, s) in enumerate(zip(offsets, sizes)) if not np.array_equal(src[o:o + s], dst[o:o + s])]
    for mh in (send_mh, recv_mh):
        plugin.check(plugin.table.deregMr(None, mh), "deregMr")
    # A host buffer the devices refuse (here: NULL) still gets a handle: staged.
    refused_code, refused = plugin.reg_mr_raw(send_comm, 0, 4096)
    if refused.value:
        plugin.check(plugin.table.deregMr(None, refused), "deregMr")
    return {"reg_codes": [code_s, code_r], "errors": errors, "bad": bad, "count": len(sizes),
            "empty": sizes.count(0), "payload": sum(sizes), **log, "refused_code": refused_code,
            "refused_handle": bool(refused.value), "messages": plugin.messages,
            "qp_errors": after["qp_errors"] - before["qp_errors"],
            "staged": after["writes_with_imm"] - before["writes_with_imm"],
            "flush_reads": after["reads"] - before["reads"],
            "writes": after["writes"] - before["writes"], "bytes": after["bytes"] - before["bytes"],
            "access_errors": after["access_errors"] - before["access_errors"]}


def ib_case_dmabuf(emu, native) -> dict:
    """GPUDirect by dma-buf: memfd arenas registered with regMrDmaBuf under
    addresses the CPU cannot touch; the primary device's port goes down mid-stream
    and comes back. Every byte is checked through the test's own mappings."""
    plugin = Plugin(11)
    props = _plugin_properties(plugin)
    send_comm, recv_comm = connect_pair(plugin)
    sizes = message_sizes(31, 300, 1 << 20)
    offsets = message_plan(sizes)
    src, dst = DmaBufArena(sum(sizes), "reccl-src"), DmaBufArena(sum(sizes), "reccl-dst")
    for i, size in enumerate(sizes):
        src.host[offsets[i]:offsets[i] + size] = message(31, i, size)
    dst.host[:] = 0xA5
    code_s, send_mh = plugin.reg_mr_dmabuf(send_comm, src.device, src.size, src.fd)
    code_r, recv_mh = plugin.reg_mr_dmabuf(recv_comm, dst.device, dst.size, dst.fd)
    # A GPU pointer without its dma-buf: the emulation has no peer memory.
    code_peer, _ = plugin.reg_mr_raw(recv_comm, dst.device, 4096, PTR_CUDA)
    plan = [(src.device + o, dst.device + o, s) for o, s in zip(offsets, sizes)]
    progress, log = [], {}
    before = emu.counters()
    errors = raw_stream(plugin, send_comm, recv_comm, plan, send_mh, recv_mh,
                        fault=flap_primary(emu, progress, 60, 150, log), progress=progress)
    after = emu.counters()
    bad = [i for i, (o, s) in enumerate(zip(offsets, sizes))
           if not np.array_equal(src.host[o:o + s], dst.host[o:o + s])]
    return {"properties": props, "reg_codes": [code_s, code_r], "peer_code": code_peer,
            "errors": errors, "bad": bad, "count": len(sizes), "empty": sizes.count(0),
            "staged": after["writes_with_imm"] - before["writes_with_imm"],
            "flush_reads": after["reads"] - before["reads"],
            "qp_errors": after["qp_errors"] - before["qp_errors"],
            "access_errors": after["access_errors"] - before["access_errors"],
            "messages": plugin.messages, **log}


def ib_case_dmabuf_refused(emu, native) -> dict:
    """What getProperties and regMrDmaBuf say where dma-buf cannot work."""
    plugin = Plugin(11)
    props = _plugin_properties(plugin)
    arena = DmaBufArena(1 << 16, "reccl-refused")
    code, _ = plugin.reg_mr_dmabuf(None, arena.device, arena.size, arena.fd)
    return {"properties": props, "code": code, "messages": plugin.messages}


def ib_case_no_gpudirect(emu, native) -> dict:
    """NICs that register dma-bufs, GPUs that cannot export them, no peer-memory
    module: no GPU memory is claimed (NCCL then stages through host memory)."""
    CUDA_EMULATION.set_dmabuf(False)
    plugin = Plugin(11)
    arena = DmaBufArena(1 << 16, "reccl-no-gdr")
    code, _ = plugin.reg_mr_dmabuf(None, arena.device, arena.size, arena.fd)
    code_cuda, _ = plugin.reg_mr_raw(None, arena.device, 4096, PTR_CUDA)
    return {"properties": _plugin_properties(plugin), "code": code, "cuda_code": code_cuda,
            "messages": plugin.messages}


def ib_case_peer_memory_only(emu, native) -> dict:
    """GPUs without dma-buf export but a peer-memory module loaded: GPU memory is
    claimed (registered by pointer), dma-buf is not."""
    CUDA_EMULATION.set_dmabuf(False)
    emu.set_peer_memory(True)
    plugin = Plugin(11)
    return {"properties": _plugin_properties(plugin), "messages": plugin.messages}


def ib_case_no_devices(emu, native) -> dict:
    """RECCL_TRANSPORT=ib over the system library of a host without RDMA devices."""
    plugin = Plugin(11, require_init=False)
    return {"init_code": plugin.init_code, "messages": plugin.messages,
            "transport": native.nccl_plugin_transport()}


IB_CASES = {"properties": ib_case_properties, "streams": ib_case_streams,
            "failover": ib_case_failover, "no_devices": ib_case_no_devices,
            "registered": ib_case_registered, "dmabuf": ib_case_dmabuf,
            "dmabuf_refused": ib_case_dmabuf_refused, "no_gpudirect": ib_case_no_gpudirect,
            "peer_memory_only": ib_case_peer_memory_only}
CUDA_EMULATION = None  # run_ib_case: the GPUs the plugin sees (they export dma-bufs unless a case says not)


def run_ib_case(name: str) -> dict:
    """One scenario in this (fresh) process: the plugin's IB transport runs over an
    emulation installed before init, except for no_devices (the system library)."""
    import torch_reccl._native as native_module

    native = native_module.native()
    global CUDA_EMULATION
    emu = None
    if name != "no_devices":
        testing = native_module.testing()
        emu = testing.IbEmulation(list(IB_DEVICES))
        testing.nccl_plugin_use_verbs(emu)
        CUDA_EMULATION = testing.CudaEmulation(2)
        testing.nccl_plugin_use_cuda(CUDA_EMULATION)
    return IB_CASES[name](emu, native)


def main() -> int:
    """One scenario over the verbs emulation (--ib-case), its report in --dir."""
    parser = argparse.ArgumentParser(description="one plugin scenario over the verbs emulation")
    parser.add_argument("--ib-case", choices=sorted(IB_CASES), required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    try:
        result = {"error": None, **run_ib_case(args.ib_case)}
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}"}
    with open(os.path.join(args.dir, f"ib-{args.ib_case}.json"), "w") as f:
        json.dump(result, f)
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
