"""One process, both ends of one NCCL-plugin connection with NVL on over the
CUDA emulation (csrc/testing/cuda_emulation.h): the sender's buffer on GPU 1, the
receiver's on GPU 0, RECCL_NIC_GPUS=0,1. Before the fault the sender's NIC 0 sits
next to GPU 0 (transit through GPU 0), the receiver's next to its own GPU
(direct); after NIC 0 goes down both ends use NIC 1, next to GPU 1: the sender
goes direct, the receiver transits through GPU 1. Prints a JSON report; run by
tests/plugin/test_nvl.py in a fresh process (the plugin is a per-process singleton).
"""
from __future__ import annotations

import ctypes as C
import json
import threading
import time

import numpy as np

from torch_reccl import _native

testing = _native.testing()
emu = testing.CudaEmulation(2)
testing.nccl_plugin_use_cuda(emu)

import torch_reccl  # noqa: E402
from torch_reccl.bench.nccl_net import PTR_CUDA, SUCCESS, Plugin, message, message_sizes  # noqa: E402

SLOT = 2 << 20     # one message slot of the registered buffers
SLOTS = 4
COUNT, FAULT_AT = 60, 20
NIC0, NIC1 = "lo:127.0.0.1", "lo:127.0.0.2"


def view(address: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((C.c_uint8 * size).from_address(address))


def wait(plugin, request, what):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        code, done, size = plugin.test(request)
        if code != SUCCESS:
            raise RuntimeError(f"{what}: test returned {code}")
        if done:
            return size
        time.sleep(0.0005)
    raise TimeoutError(f"{what} did not complete")


def nvl_bytes():
    nics = torch_reccl.stats()["nics"]
    return {name: nics[name]["nvl_bytes"] for name in (NIC0, NIC1)}


def pipelined(plugin, send_comm, recv_comm, send_buffer, recv_buffer, send_mr, recv_mr) -> dict:
    """SLOTS messages in flight at once while every copy looks busy for a few
    polls, tested newest first: staged sends must reach the connection in isend
    order (else message k+1's bytes land in receive k), each exact."""
    emu.set_queries_before_done(4)
    sizes = [SLOT - 1, 3, SLOT // 3, SLOT]
    expected = [message(7, i, s) for i, s in enumerate(sizes)]
    recv_buffer[:] = 0
    requests = []
    for i, size in enumerate(sizes):
        slot = i * SLOT
        send_buffer[slot:slot + size] = expected[i]
        _, recv = plugin.irecv(recv_comm, [recv_buffer[slot:slot + SLOT]], recv_mr)
        requests.append((recv, f"pipelined receive {i}"))
    for i, size in enumerate(sizes):
        slot = i * SLOT
        requests.append((plugin.isend(send_comm, send_buffer[slot:slot + size], send_mr), f"pipelined send {i}"))
    not_done_at_once = 0
    pending = list(reversed(requests))
    deadline = time.monotonic() + 20
    while pending and time.monotonic() < deadline:
        for request, what in list(pending):
            code, done, _ = plugin.test(request)
            if code != SUCCESS:
                raise RuntimeError(f"{what}: test returned {code}")
            if done:
                pending.remove((request, what))
            else:
                not_done_at_once += 1
    emu.set_queries_before_done(1)
    wrong = [i for i, size in enumerate(sizes)
             if not np.array_equal(recv_buffer[i * SLOT:i * SLOT + size], expected[i])]
    return {"left": len(pending), "wrong": wrong, "polls_not_done": not_done_at_once}


def copy_slots_run_out(plugin, send_comm, recv_comm, send_buffer, recv_buffer, send_mr, recv_mr) -> dict:
    """More staged sends than copy slots: the one past the limit gets a NULL
    request (NCCL retries), not an error; all arrive exact once retried."""
    emu.set_queries_before_done(1000)  # every copy stays "in flight" until polled 1000 times
    piece, count = 1024, 17
    expected = [message(9, i, piece) for i in range(count)]
    for i in range(count):
        send_buffer[i * piece:(i + 1) * piece] = expected[i]
    sends = []
    for i in range(count):
        request = C.c_void_p()
        code = plugin.table.isend(send_comm, send_buffer[i * piece:].ctypes.data, piece, 0, send_mr, None,
                                  C.byref(request))
        if code != SUCCESS:
            raise RuntimeError(f"isend {i} returned {code}")
        sends.append(request)
    accepted = sum(1 for r in sends if r.value)
    emu.set_queries_before_done(1)
    recv_buffer[:] = 0
    receives = []
    for i in range(count):
        _, recv = plugin.irecv(recv_comm, [recv_buffer[i * piece:(i + 1) * piece]], recv_mr)
        receives.append(recv)
    for i in range(count):
        if not sends[i].value:  # the retry NCCL would make
            sends[i] = plugin.isend(send_comm, send_buffer[i * piece:(i + 1) * piece], send_mr)
        wait(plugin, sends[i], f"slot send {i}")
    for i in range(count):
        wait(plugin, receives[i], f"slot receive {i}")
    wrong = [i for i in range(count)
             if not np.array_equal(recv_buffer[i * piece:(i + 1) * piece], expected[i])]
    return {"accepted_at_once": accepted, "count": count, "wrong": wrong}


def main() -> dict:
    plugin = Plugin(11)
    report = {"ptrSupport": plugin.properties(0).ptrSupport, "messages": plugin.messages}
    handle, listen_comm = plugin.listen(0)
    box = []
    connector = threading.Thread(target=lambda: box.append(plugin.connect(0, handle)))
    connector.start()
    recv_comm = plugin.accept(listen_comm)
    connector.join(30)
    send_comm = box[0]

    send_address, recv_address = emu.alloc(1, SLOT * SLOTS), emu.alloc(0, SLOT * SLOTS)
    send_buffer, recv_buffer = view(send_address, SLOT * SLOTS), view(recv_address, SLOT * SLOTS)
    code, send_mr = plugin.reg_mr(send_comm, send_buffer, PTR_CUDA)
    assert code == SUCCESS, plugin.messages
    code, recv_mr = plugin.reg_mr(recv_comm, recv_buffer, PTR_CUDA)
    assert code == SUCCESS, plugin.messages
    report["registered"] = {"stats": torch_reccl.stats()["nvl_transit_bytes"], "emulation": emu.counters()}
    # A cudaMalloc buffer belongs to the application's context: copying it from ours
    # would wait for that context's lock, so registering it is refused.
    legacy_address = emu.alloc(0, SLOT, virtual_memory=False)
    code, _ = plugin.reg_mr(send_comm, view(legacy_address, SLOT), PTR_CUDA)
    report["legacy_code"] = code
    report["after_legacy"] = {"stats": torch_reccl.stats()["nvl_transit_bytes"], "emulation": emu.counters()}
    emu.free(0, legacy_address)

    sizes = message_sizes(5, COUNT, SLOT)
    wrong = []
    for index, size in enumerate(sizes):
        if index == FAULT_AT:
            report["nvl_before_fault"] = nvl_bytes()
            torch_reccl.inject_fault(NIC0, "down")
        slot = (index % SLOTS) * SLOT
        expected = message(5, index, int(size))
        send_buffer[slot:slot + size] = expected
        recv_buffer[slot:slot + SLOT] = 0
        _, recv_request = plugin.irecv(recv_comm, [recv_buffer[slot:slot + SLOT]], recv_mr)
        send_request = plugin.isend(send_comm, send_buffer[slot:slot + size], send_mr)
        wait(plugin, send_request, f"send {index}")
        got = wait(plugin, recv_request, f"receive {index}")
        if got != size or not np.array_equal(recv_buffer[slot:slot + size], expected):
            wrong.append(index)
    report["wrong"] = wrong
    report["nvl_after"] = nvl_bytes()
    report["bytes"] = int(sum(sizes))
    report["streamed"] = emu.counters()
    report["pipelined"] = pipelined(plugin, send_comm, recv_comm, send_buffer, recv_buffer, send_mr, recv_mr)
    report["slots"] = copy_slots_run_out(plugin, send_comm, recv_comm, send_buffer, recv_buffer, send_mr,
                                         recv_mr)

    # A message outside its registered buffer is refused, not copied.
    request = C.c_void_p()
    code = plugin.table.isend(send_comm, send_address + SLOT * SLOTS - 16, 64, 0, send_mr, None,
                              C.byref(request))
    report["outside_code"] = code

    assert plugin.table.deregMr(send_comm, send_mr) == SUCCESS
    assert plugin.table.deregMr(recv_comm, recv_mr) == SUCCESS
    report["released"] = {"stats": torch_reccl.stats()["nvl_transit_bytes"], "emulation": emu.counters()}
    plugin.table.closeSend(send_comm)
    plugin.table.closeRecv(recv_comm)
    plugin.table.closeListen(listen_comm)
    report["messages"] = plugin.messages
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
