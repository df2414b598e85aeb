"""Store traffic of bench/scale.py's jobs: a counting proxy in front of the TCPStore server.

Every store request of every rank (also those of cloned stores, which connect to the
same address) passes the proxy, which counts them per phase. Counted two ways:
"reads" (client->server recv() calls that returned data; TCPStore's client writes each
request with one send(), so on loopback a read is about one request, but two requests
sent back to back can arrive in one read) and "requests", parsed from the byte stream
with TCPStore's wire format (exact while the format is the one parsed here; a
connection whose bytes stop parsing falls back to counting reads only, reported as
"unparsed"). Bytes are counted too.
"""
from __future__ import annotations

import json
import re
import selectors
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Tuple

# --------------------------------------------------------------------------- TCPStore wire format

# c10d::detail::QueryType (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, torch 2.13)
QUERY_NAMES = ("VALIDATE", "SET", "COMPARE_SET", "GET", "ADD", "CHECK", "WAIT", "GETNUMKEYS",
               "DELETE_KEY", "APPEND", "MULTI_GET", "MULTI_SET", "CANCEL_WAIT", "PING",
               "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN", "LIST_KEYS", "BARRIER")
# fields after the type byte: u32/i64 fixed values, "key"/"payload" = u64 length + bytes,
# "keys" = u64 count + that many keys, "kv" = u64 count + that many (key, payload)
_LAYOUT = {
    "VALIDATE": ("u32",), "SET": ("key", "payload"), "COMPARE_SET": ("key", "payload", "payload"),
    "GET": ("key",), "ADD": ("key", "i64"), "CHECK": ("keys",), "WAIT": ("keys",),
    "GETNUMKEYS": (), "DELETE_KEY": ("key",), "APPEND": ("key", "payload"),
    "MULTI_GET": ("keys",), "MULTI_SET": ("kv",), "CANCEL_WAIT": (), "PING": ("u32",),
    "QUEUE_PUSH": ("key", "payload"), "QUEUE_POP": ("key",), "QUEUE_LEN": ("key",),
    "LIST_KEYS": (), "BARRIER": ("key", "i64"),
}
_MAX_LEN = 1 << 31


class _Incomplete(Exception):
    pass


class RequestParser:
    """Splits one client->server byte stream into TCPStore requests.

    feed() returns the requests completed by the new bytes as (type, first key or
    None, number of keys). On bytes that do not parse (an unknown type, an absurd
    length) the parser gives up for good (``broken``); the proxy then counts reads only.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.broken = False

    def feed(self, data: bytes) -> List[Tuple[str, Optional[str], int]]:
        if self.broken:
            return []
        self.buf += data
        out = []
        while self.buf:
            try:
                request, used = self._parse_one()
            except _Incomplete:
                break
            except ValueError:
                self.broken = True
                self.buf.clear()
                break
            del self.buf[:used]
            out.append(request)
        return out

    def _parse_one(self):
        buf, pos = self.buf, 1
        qtype = buf[0]
        if qtype >= len(QUERY_NAMES):
            raise ValueError(f"unknown query type {qtype}")
        name = QUERY_NAMES[qtype]

        def need(n):
            if pos + n > len(buf):
                raise _Incomplete

        def u64():
            nonlocal pos
            need(8)
            (value,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
            if value > _MAX_LEN:
                raise ValueError("absurd length")
            return value

        def blob():
            nonlocal pos
            n = u64()
            need(n)
            value = bytes(buf[pos:pos + n])
            pos += n
            return value

        keys: List[str] = []
        for field in _LAYOUT[name]:
            if field == "u32":
                need(4)
                pos += 4
            elif field == "i64":
                need(8)
                pos += 8
            elif field == "key":
                keys.append(blob().decode("utf-8", "replace"))
            elif field == "payload":
                blob()
            elif field == "keys":
                for _ in range(u64()):
                    keys.append(blob().decode("utf-8", "replace"))
            elif field == "kv":
                for _ in range(u64()):
                    keys.append(blob().decode("utf-8", "replace"))
                    blob()
        return (name, keys[0] if keys else None, len(keys)), pos


def key_pattern(key: Optional[str]) -> str:
    """A key with every digit run replaced by '#', to group per-rank/per-group keys."""
    return "" if key is None else re.sub(r"\d+", "#", key)


# --------------------------------------------------------------------------- counting proxy


class _Side:
    __slots__ = ("sock", "peer", "out", "is_client", "conn_id", "parser", "reading")

    def __init__(self, sock, is_client, conn_id):
        self.sock, self.is_client, self.conn_id = sock, is_client, conn_id
        self.peer: Optional["_Side"] = None
        self.out = bytearray()
        self.parser = RequestParser() if is_client else None
        self.reading = True


class CountingProxy:
    """A TCP proxy in front of a TCPStore server that counts client->server traffic per phase.

    One thread and one selector (epoll on Linux) serve every connection; nothing
    wakes it but traffic (a socketpair stops it). Counts per phase: reads (recv()
    calls that returned client bytes), bytes, parsed requests (by type and key
    pattern, plus the first ``samples`` requests verbatim), connections opened,
    and reads/bytes in the server->client direction.
    """

    MAX_BUFFERED = 8 << 20  # stop reading a side while its peer has this much unsent

    def __init__(self, upstream_port: int, host: str = "127.0.0.1", samples: int = 40) -> None:
        self.upstream = (host, upstream_port)
        self.samples = samples
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, 0))
        self.listener.listen(4096)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._phase = "start"
        self._phase_start = time.monotonic()
        self._counts: Dict[str, dict] = {}
        self._stop = False
        self._next_id = 0
        self.open_connections = 0
        self.thread = threading.Thread(target=self._loop, name="scale-proxy", daemon=True)

    # -- public
    def start(self) -> "CountingProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5)

    def set_phase(self, name: str) -> None:
        with self._lock:
            self._phase = name
            self._phase_start = time.monotonic()

    def counts(self, phase: Optional[str] = None) -> dict:
        """A copy of the counts of one phase (zeros if none), or of all phases."""
        with self._lock:
            if phase is not None:
                return json.loads(json.dumps(self._counts.get(phase) or self._new_counts()))
            return json.loads(json.dumps(self._counts))

    # -- internals
    @staticmethod
    def _new_counts() -> dict:
        return {"reads": 0, "bytes": 0, "requests": 0, "unparsed_reads": 0, "connections": 0,
                "reply_reads": 0, "reply_bytes": 0, "by_type": {}, "by_key": {}, "samples": []}

    def _bucket(self) -> dict:
        bucket = self._counts.get(self._phase)
        if bucket is None:
            bucket = self._counts[self._phase] = self._new_counts()
        return bucket

    def _loop(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        while not self._stop:
            for key, events in self.selector.select():
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(64)
                else:
                    side = key.data
                    if events & selectors.EVENT_WRITE:
                        self._flush(side)
                    if events & selectors.EVENT_READ and side.sock.fileno() >= 0:
                        self._read(side)
        for key in list(self.selector.get_map().values()):
            try:
                key.fileobj.close()
            except OSError:
                pass
        self.selector.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
            self._next_id += 1
            a, b = _Side(client, True, self._next_id), _Side(server, False, self._next_id)
            a.peer, b.peer = b, a
            self.selector.register(client, selectors.EVENT_READ, a)
            self.selector.register(server, selectors.EVENT_READ, b)
            self.open_connections += 1
            with self._lock:
                self._bucket()["connections"] += 1

    def _interest(self, side: _Side) -> None:
        """(Re)registers a side for what it waits on: reading (unless paused), writing (if it has output)."""
        if side.sock.fileno() < 0:
            return
        events = (selectors.EVENT_READ if side.reading else 0) | (selectors.EVENT_WRITE if side.out else 0)
        try:
            if events:
                try:
                    self.selector.modify(side.sock, events, side)
                except KeyError:
                    self.selector.register(side.sock, events, side)
            else:
                self.selector.unregister(side.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _close(self, side: _Side) -> None:
        """Closes a connection: both sides."""
        closed_any = False
        for s in (side, side.peer):
            if s is None or s.sock.fileno() < 0:
                continue
            try:
                self.selector.unregister(s.sock)
            except (KeyError, ValueError):
                pass
            s.sock.close()
            closed_any = True
        if closed_any:
            self.open_connections -= 1

    def _read(self, side: _Side) -> None:
        try:
            data = side.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # one end closed: deliver what is pending to the other, then close both
            peer = side.peer
            if peer.out and peer.sock.fileno() >= 0:
                try:
                    peer.sock.setblocking(True)
                    peer.sock.settimeout(1)
                    peer.sock.sendall(bytes(peer.out))
                except OSError:
                    pass
            self._close(side)
            return
        now = time.monotonic()
        with self._lock:
            bucket = self._bucket()
            if side.is_client:
                bucket["reads"] += 1
                bucket["bytes"] += len(data)
                broken_before = side.parser.broken
                requests = side.parser.feed(data)
                if side.parser.broken:
                    bucket["unparsed_reads"] += 1
                    if not broken_before:
                        bucket["samples"].append(f"conn {side.conn_id}: bytes stopped parsing")
                for qtype, key, nkeys in requests:
                    bucket["requests"] += 1
                    bucket["by_type"][qtype] = bucket["by_type"].get(qtype, 0) + 1
                    pattern = f"{qtype} {key_pattern(key)}".strip()
                    bucket["by_key"][pattern] = bucket["by_key"].get(pattern, 0) + 1
                    if len(bucket["samples"]) < self.samples:
                        more = f" (+{nkeys - 1} keys)" if nkeys > 1 else ""
                        bucket["samples"].append(f"+{now - self._phase_start:.3f}s conn {side.conn_id}: "
                                                 f"{qtype} {key or ''}{more}".rstrip())
            else:
                bucket["reply_reads"] += 1
                bucket["reply_bytes"] += len(data)
        peer = side.peer
        peer.out += data
        self._flush(peer)
        if len(peer.out) > self.MAX_BUFFERED:
            side.reading = False
            self._interest(side)

    def _flush(self, side: _Side) -> None:
        if side.sock.fileno() < 0:
            return
        while side.out:
            try:
                sent = side.sock.send(side.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(side)
                return
            del side.out[:sent]
        self._interest(side)
        peer = side.peer
        if peer is not None and not peer.reading and len(side.out) <= self.MAX_BUFFERED // 2 \
                and peer.sock.fileno() >= 0:
            peer.reading = True
            self._interest(peer)
