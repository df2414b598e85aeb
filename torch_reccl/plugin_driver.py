"""The NCCL net plugin's exported tables, driven from Python as NCCL drives them.

libnccl-net-reccl.so is dlopened with ctypes and each ``ncclNetPlugin_vN`` table
(v8, v10, v11, v12) is read through a ctypes mirror of its layout (nccl_abi.h's
structs, field for field). :class:`Plugin` makes the calls NCCL's setup and
proxy threads make: init with a logger, devices and properties, listen, connect
and accept (non-blocking, retried until they return a comm), memory
registration, isend/irecv (a NULL request means "retry later") and test().
No torch and no NCCL in the process: the library alone, as NCCL loads it.
Used by ``reccl soak``'s plugin stream (torch_reccl/soak/plugin_stream.py) and
the plugin's tests.
"""
from __future__ import annotations

import ctypes as C
import functools
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
