"""The low-level connection API, for tests and tools.

A :class:`Transport` owns the process's NICs (``RECCL_NICS``). The receiving side
calls ``listen(nic)`` and passes ``listener.handle`` (128 bytes, includes the
handshake secret) to the sender out of band; the sender calls
``connect(nic, handle)`` and ``wait_ready()``; the receiver ``accept()``s.
Connections are one-way, as in NCCL: ``isend`` on the sending side, ``irecv`` on
the receiving side, matched in posting order. Both take any contiguous buffer
(bytes/bytearray/numpy array/memoryview; irecv needs it writable) and return a
:class:`Request` with ``test() -> (done, nbytes)`` and ``wait(timeout) -> nbytes``.
The buffer must not change until the request completes. A send completes when
the receiver has every byte, so a completed send survives any later fault.

Example::

    t = Transport({"RECCL_NICS": "127.0.0.1,127.0.0.2"})
    listener = t.listen(0)
    sc = t.connect(0, listener.handle); sc.wait_ready(10)
    rc = listener.accept(10)
    buf = bytearray(5); r = rc.irecv(buf); sc.isend(b"hello").wait(10); r.wait(10)
"""
from torch_reccl._native import native

_C = native()
Transport = _C.Transport
Listener = _C.Listener
SendConnection = _C.SendConnection
RecvConnection = _C.RecvConnection
Request = _C.Request
RecclError = _C.RecclError
ConfigError = _C.ConfigError
ProtocolError = _C.ProtocolError
TimeoutError = _C.TimeoutError
HANDLE_BYTES = _C.HANDLE_BYTES
# The IB verbs transport (docs/ib.md): IbTransport(verbs=None | a VerbsProvider,
# env, bootstrap_address) has the same listen/connect as Transport. The verbs
# emulation is torch_reccl._testing.IbEmulation (torch_reccl._native.testing()).
IbTransport = _C.IbTransport

__all__ = [
    "Transport", "Listener", "SendConnection", "RecvConnection", "Request",
    "RecclError", "ConfigError", "ProtocolError", "TimeoutError", "HANDLE_BYTES",
    "IbTransport",
]
