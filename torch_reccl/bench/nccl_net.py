"""The NCCL net plugin driven as NCCL's proxy drives it.

libnccl-net-reccl.so is dlopened with ctypes, each `ncclNetPlugin_vN` table is read
through a ctypes mirror of its layout, and a sender and a receiver exchange
messages with many requests in flight, polling `test()` (``Plugin``,
``send_stream``, ``receive_stream``, ``run_pair``). As a program it runs one side
of a cross-host stream inside an emulated host:

    python -m torch_reccl.bench.nccl_net --role recv|send --dir DIR

Shared by the plugin's tests and by bench/outage_fabric.py and bench/plugin_spread.py
(through torch_reccl.bench.spread_peer).
"""
from __future__ import annotations

import argparse
import ctypes as C
import functools
import json
import os
import sys
import threading
import time

import numpy as np

SUCCESS, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, REMOTE_ERROR = 0, 2, 3, 4, 6
PTR_HOST, PTR_CUDA, PTR_DMABUF = 1, 2, 4
HANDLE_BYTES = 128
VERSIONS = (8, 10, 11, 12)

vp = C.c_void_p
pvp = C.POINTER(C.c_void_p)
res = C.c_int
# NCCL's logger is variadic; ctypes cannot declare that, so the mirror takes one
# extra pointer argument: on x86-64 (and AArch64 Linux) the first variadic
# argument travels in the next integer register, exactly as a sixth parameter.
# It is read only when the format's first conversion is %s (every format this
# plugin logs with).
Logger = C.CFUNCTYPE(None, C.c_int, C.c_ulong, C.c_char_p, C.c_int, C.c_char_p, C.c_void_p)


def _fn(*args):
    return C.CFUNCTYPE(res, *args)


def _props_fields(version):
    fields = [("name", C.c_char_p), ("pciPath", C.c_char_p), ("guid", C.c_uint64),
              ("ptrSupport", C.c_int), ("regIsGlobal", C.c_int)]
    if version >= 10:
        fields.append(("forceFlush", C.c_int))
    fields += [("speed", C.c_int), ("port", C.c_int), ("latency", C.c_float),
               ("maxComms", C.c_int), ("maxRecvs", C.c_int), ("netDeviceType", C.c_int),
               ("netDeviceVersion", C.c_int)]
    if version >= 10:
        fields += [("vNdevs", C.c_int), ("vDevs", C.c_int * (8 if version >= 12 else 4)),
                   ("maxP2pBytes", C.c_size_t), ("maxCollBytes", C.c_size_t)]
    if version >= 11:
        fields.append(("maxMultiRequestSize", C.c_int))
    if version >= 12:
        fields += [("railId", C.c_int16), ("planeId", C.c_int16)]
    return fields


@functools.lru_cache(maxsize=None)
def props_type(version):
    return type(f"Props{version}", (C.Structure,), {"_fields_": _props_fields(version)})


@functools.lru_cache(maxsize=None)
def table_type(version):
    props = C.POINTER(props_type(version))
    size_t = C.c_int if version == 8 else C.c_size_t
    fields = [("name", C.c_char_p)]
    if version == 8:
        fields.append(("init", _fn(Logger)))
    elif version == 10:
        fields.append(("init", _fn(Logger, vp)))
    else:
        fields.append(("init", _fn(pvp, C.c_uint64, vp, Logger, vp)))
    fields += [("devices", _fn(C.POINTER(C.c_int))), ("getProperties", _fn(C.c_int, props))]
    if version >= 11:
        fields += [("listen", _fn(vp, C.c_int, vp, pvp)), ("connect", _fn(vp, C.c_int, vp, pvp, pvp))]
    elif version == 10:
        fields += [("listen", _fn(C.c_int, vp, pvp)), ("connect", _fn(C.c_int, vp, vp, pvp, pvp))]
    else:
        fields += [("listen", _fn(C.c_int, vp, pvp)), ("connect", _fn(C.c_int, vp, pvp, pvp))]
    fields += [("accept", _fn(vp, pvp, pvp)),
               ("regMr", _fn(vp, vp, C.c_size_t, C.c_int, pvp)),
               ("regMrDmaBuf", _fn(vp, vp, C.c_size_t, C.c_int, C.c_uint64, C.c_int, pvp)),
               ("deregMr", _fn(vp, vp))]
    if version == 8:
        fields += [("isend", _fn(vp, vp, C.c_int, C.c_int, vp, pvp)),
                   ("irecv", _fn(vp, C.c_int, pvp, C.POINTER(C.c_int), C.POINTER(C.c_int), pvp, pvp))]
    else:
        fields += [("isend", _fn(vp, vp, size_t, C.c_int, vp, vp, pvp)),
                   ("irecv", _fn(vp, C.c_int, pvp, C.POINTER(size_t), C.POINTER(C.c_int), pvp, pvp, pvp))]
    fields += [("iflush", _fn(vp, C.c_int, pvp, C.POINTER(C.c_int), pvp, pvp)),
               ("test", _fn(vp, C.POINTER(C.c_int), C.POINTER(C.c_int))),
               ("closeSend", _fn(vp)), ("closeRecv", _fn(vp)), ("closeListen", _fn(vp)),
               ("getDeviceMr", _fn(vp, vp, pvp)), ("irecvConsumed", _fn(vp, C.c_int, vp))]
    if version >= 10:
        fields.append(("makeVDevice", vp))
    if version >= 11:
        fields += [("finalize", _fn(vp)), ("setNetAttr", _fn(vp, vp))]
    return type(f"Net{version}", (C.Structure,), {"_fields_": fields})


def library_path() -> str:
    """libnccl-net-reccl.so, the library NCCL loads (torch_reccl._C links it)."""
    import torch_reccl._native as native

    return native.plugin_path()


class Plugin:
    """One version's table, with NCCL-like calls that raise on an error code."""

    def __init__(self, version: int, path: str | None = None, require_init: bool = True):
        self.version = version
        self.lib = C.CDLL(path or library_path())
        self.table = table_type(version).in_dll(self.lib, f"ncclNetPlugin_v{version}")
        self.messages = []
        self._logger = Logger(self._log)
        self.ctx = vp()
        if version == 8:
            self.init_code = self.table.init(self._logger)
        elif version == 10:
            self.init_code = self.table.init(self._logger, None)
        else:
            self.init_code = self.table.init(C.byref(self.ctx), 1, None, self._logger, None)
        if require_init:
            self.check(self.init_code, "init")

    def _log(self, level, flags, file, line, fmt, first):
        text = fmt.decode(errors="replace")
        conversion = text.find("%")
        if conversion >= 0 and text[conversion:conversion + 2] == "%s" and first:
            text = text.replace("%s", C.string_at(first).decode(errors="replace"), 1)
        self.messages.append(text)

    @staticmethod
    def check(code: int, what: str) -> None:
        if code != SUCCESS:
            raise RuntimeError(f"{what} returned ncclResult {code}")

    def devices(self) -> int:
        n = C.c_int()
        self.check(self.table.devices(C.byref(n)), "devices")
        return n.value

    def properties(self, dev: int):
        props = props_type(self.version)()
        self.check(self.table.getProperties(dev, C.byref(props)), "getProperties")
        return props

    def listen(self, dev: int):
        handle = C.create_string_buffer(HANDLE_BYTES)
        comm = vp()
        if self.version >= 11:
            self.check(self.table.listen(self.ctx, dev, handle, C.byref(comm)), "listen")
        else:
            self.check(self.table.listen(dev, handle, C.byref(comm)), "listen")
        return handle.raw, comm

    def connect(self, dev: int, handle: bytes, timeout: float = 30.0):
        buffer = C.create_string_buffer(handle, HANDLE_BYTES)
        comm, dev_comm = vp(), vp()
        deadline = time.monotonic() + timeout
        while not comm.value:
            if self.version >= 11:
                code = self.table.connect(self.ctx, dev, buffer, C.byref(comm), C.byref(dev_comm))
            elif self.version == 10:
                code = self.table.connect(dev, None, buffer, C.byref(comm), C.byref(dev_comm))
            else:
                code = self.table.connect(dev, buffer, C.byref(comm), C.byref(dev_comm))
            self.check(code, "connect")
            if time.monotonic() > deadline:
                raise TimeoutError("connect did not complete")
            time.sleep(0.001)
        return comm

    def accept(self, listen_comm, timeout: float = 30.0):
        comm, dev_comm = vp(), vp()
        deadline = time.monotonic() + timeout
        while not comm.value:
            self.check(self.table.accept(listen_comm, C.byref(comm), C.byref(dev_comm)), "accept")
            if time.monotonic() > deadline:
                raise TimeoutError("accept did not complete")
            time.sleep(0.001)
        return comm

    def reg_mr(self, comm, array: np.ndarray, kind: int = PTR_HOST):
        return self.reg_mr_raw(comm, array.ctypes.data, array.nbytes, kind)

    def reg_mr_raw(self, comm, address: int, size: int, kind: int = PTR_HOST):
        handle = vp()
        code = self.table.regMr(comm, address, size, kind, C.byref(handle))
        return code, handle

    def reg_mr_dmabuf(self, comm, address: int, size: int, fd: int, offset: int = 0,
                      kind: int = PTR_CUDA):
        handle = vp()
        code = self.table.regMrDmaBuf(comm, address, size, kind, offset, fd, C.byref(handle))
        return code, handle

    def isend(self, comm, array: np.ndarray, mhandle):
        return self.isend_raw(comm, array.ctypes.data, array.nbytes, mhandle)

    def isend_raw(self, comm, address: int, size: int, mhandle):
        request = vp()
        if self.version == 8:
            code = self.table.isend(comm, address, size, 0, mhandle, C.byref(request))
        else:
            code = self.table.isend(comm, address, size, 0, mhandle, None, C.byref(request))
        self.check(code, "isend")
        return request

    def irecv(self, comm, arrays, mhandle, check: bool = True):
        return self.irecv_raw(comm, [(a.ctypes.data, a.nbytes) for a in arrays], mhandle, check)

    def irecv_raw(self, comm, buffers, mhandle, check: bool = True):
        """`buffers`: (address, size) pairs."""
        n = len(buffers)
        data = (vp * n)(*[address for address, _ in buffers])
        size_t = C.c_int if self.version == 8 else C.c_size_t
        sizes = (size_t * n)(*[size for _, size in buffers])
        tags = (C.c_int * n)()
        mhandles = (vp * n)(*[mhandle] * n)
        request = vp()
        if self.version == 8:
            code = self.table.irecv(comm, n, data, sizes, tags, mhandles, C.byref(request))
        else:
            code = self.table.irecv(comm, n, data, sizes, tags, mhandles, None, C.byref(request))
        if check:
            self.check(code, "irecv")
        return code, request

    def iflush(self, comm, buffers, mhandle):
        """iflush for received (address, size) pairs: (code, request)."""
        n = len(buffers)
        data = (vp * n)(*[address for address, _ in buffers])
        sizes = (C.c_int * n)(*[size for _, size in buffers])
        mhandles = (vp * n)(*[mhandle] * n)
        request = vp()
        code = self.table.iflush(comm, n, data, sizes, mhandles, C.byref(request))
        return code, request

    def test(self, request):
        done, size = C.c_int(), C.c_int()
        code = self.table.test(request, C.byref(done), C.byref(size))
        return code, bool(done.value), size.value


def message(seed: int, index: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, index]).integers(0, 256, size, dtype=np.uint8)


def message_sizes(seed: int, count: int, max_bytes: int):
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(0, np.log(max_bytes), count)).astype(np.int64)
    sizes[0], sizes[1] = 0, max_bytes
    return [int(s) for s in sizes]


def pump_requests(plugin: Plugin, what: str, count: int, post, on_done, window: int,
                  deadline: float) -> None:
    """One side of NCCL's proxy loop: keep up to `window` requests posted (`post(i)`
    returns request i; a NULL one is retried later), poll test(), and call
    `on_done(i, size)` as each completes."""
    inflight, next_index = [], 0
    while next_index < count or inflight:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} stuck with {len(inflight)} in flight at {next_index}")
        while next_index < count and len(inflight) < window:
            request = post(next_index)
            if not request.value:
                break  # NCCL retries a NULL request later
            inflight.append((next_index, request))
            next_index += 1
        still = []
        for index, request in inflight:
            code, done, size = plugin.test(request)
            plugin.check(code, f"test({what} {index})")
            if done:
                on_done(index, size)
            else:
                still.append((index, request))
        inflight = still


def send_stream(plugin: Plugin, comm, sizes, seed: int, window: int, deadline: float):
    """Sender half of NCCL's proxy: post isends (retrying NULL requests), poll test()."""
    arrays = [message(seed, i, s) for i, s in enumerate(sizes)]
    _, mhandle = plugin.reg_mr(comm, arrays[1])

    def done(index, size):
        if size != sizes[index]:
            raise AssertionError(f"send {index}: test says {size} bytes, sent {sizes[index]}")

    pump_requests(plugin, "sender", len(sizes), lambda i: plugin.isend(comm, arrays[i], mhandle),
                  done, window, deadline)


def receive_stream(plugin: Plugin, comm, sizes, seed: int, window: int, deadline: float,
                   progress: list | None = None):
    """Receiver half; checks every byte; appends each intact message's index to `progress`."""
    buffers = [np.zeros(s, np.uint8) for s in sizes]
    _, mhandle = plugin.reg_mr(comm, buffers[1])
    good = []

    def done(index, size):
        if size != sizes[index] or not np.array_equal(buffers[index], message(seed, index, sizes[index])):
            raise AssertionError(f"message {index} differs ({size} bytes)")
        good.append(index)
        buffers[index] = None
        if progress is not None:
            progress.append(index)

    pump_requests(plugin, "receiver", len(sizes),
                  lambda i: plugin.irecv(comm, [buffers[i]], mhandle)[1], done, window, deadline)
    return len(good)


def connect_pair(plugin: Plugin):
    """listen, connect and accept on device 0 as NCCL's setup does: (send, recv) comms."""
    handle, listen_comm = plugin.listen(0)
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
    return send_comm_box[0], recv_comm


def run_pair(version: int, sizes, window: int = 8, fault=None, progress: list | None = None):
    """One plugin talks to itself (connect_pair), then a sender and a receiver
    "proxy" thread stream `sizes`; `fault()` runs on the calling thread meanwhile
    (`progress` gets each intact message's index as it arrives). Returns (errors,
    [messages received intact])."""
    plugin = Plugin(version)
    errors, good = [], []
    send_comm, recv_comm = connect_pair(plugin)
    deadline = time.monotonic() + 60

    def sender():
        try:
            send_stream(plugin, send_comm, sizes, 3, window, deadline)
        except Exception as error:
            errors.append(f"send: {error}")

    def receiver():
        try:
            good.append(receive_stream(plugin, recv_comm, sizes, 3, window, deadline, progress))
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


def main() -> int:
    """One side of a cross-host run: --role recv|send, the handle passed through --dir."""
    parser = argparse.ArgumentParser(description="one side of a cross-host stream through the NCCL net plugin")
    parser.add_argument("--role", choices=["recv", "send"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--version", type=int, default=11)
    parser.add_argument("--messages", type=int, default=150)
    parser.add_argument("--max-bytes", type=int, default=8 << 20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--deadline", type=float, default=60)
    parser.add_argument("--inject-down", help="NIC to fail (inject_fault) before anything else")
    args = parser.parse_args()
    import torch_reccl

    plugin_first = Plugin(args.version) if args.inject_down else None
    if args.inject_down:
        torch_reccl.inject_fault(args.inject_down, "down")

    events = []
    torch_reccl.on_event(lambda e: events.append(e.to_dict()))
    deadline = time.monotonic() + args.deadline
    plugin = plugin_first or Plugin(args.version)
    sizes = message_sizes(args.seed, args.messages, args.max_bytes)
    result = {"role": args.role, "error": None}
    handle_path = os.path.join(args.dir, "handle")
    progress_path = os.path.join(args.dir, f"progress-{args.role}")
    try:
        if args.role == "recv":
            handle, listen_comm = plugin.listen(0)
            with open(handle_path + ".tmp", "wb") as f:
                f.write(handle)
            os.rename(handle_path + ".tmp", handle_path)
            comm = plugin.accept(listen_comm)
            plugin.check(plugin.table.closeListen(listen_comm), "closeListen")  # as NCCL does
            open(progress_path, "w").close()
            result["good"] = receive_stream(plugin, comm, sizes, args.seed, 8, deadline)
            plugin.check(plugin.table.closeRecv(comm), "closeRecv")
        else:
            while not os.path.exists(handle_path):
                if time.monotonic() > deadline:
                    raise TimeoutError("no handle")
                time.sleep(0.01)
            with open(handle_path, "rb") as f:
                comm = plugin.connect(0, f.read())
            open(progress_path, "w").close()
            send_stream(plugin, comm, sizes, args.seed, 8, deadline)
            plugin.check(plugin.table.closeSend(comm), "closeSend")
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    torch_reccl.events.flush_events()
    result["events"] = events
    with open(os.path.join(args.dir, f"result-{args.role}.json"), "w") as f:
        json.dump(result, f)
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
