"""Step 2 of ``reccl qualify``: every rail between every pair of hosts connects.

Each host's lowest rank checks, rail by rail, every other host when there are at
most :data:`FULL_MESH_MAX_HOSTS` hosts (both directions of every pair), else its
two ring neighbours (so the work per host stays constant as the job grows):

- **TCP**: a plain socket from this host's rail-*r* address to the peer's rail-*r*
  address connects, and echoes 8 bytes (round-trip time, median of
  :data:`ROUNDS`);
- **HELLO**: reccl's own transport, made over that one NIC, dials the peer's
  listener with the handle (and so the secret) the peer published, and the peer's
  acceptor takes the handshake; the round-trip time is that of an 8-byte send,
  which completes on the receiver's acknowledgement;
- **verbs**, where the hosts have RDMA devices and libibverbs loads: the same over
  reccl's IB transport, one device (rail) at a time; ready means the queue pair is
  up and its probe RDMA write landed.

Every dial shares one deadline (``--reach-timeout``); what has not connected by
then fails, with the transport's view of the path. A handshake the peer refused
shows up there as the peer's ``handshake_rejected`` events (wrong secret, wire
version), which the report quotes.
"""
from __future__ import annotations

import base64
import selectors
import socket
import statistics
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

FULL_MESH_MAX_HOSTS = 16
ROUNDS = 10
PING_SLACK_S = 5.0      # after the dial deadline: how long a ping may still take
ACCEPT_POLL_S = 0.005
PING = 8                # bytes of a probe message


def targets(hosts: int, host: int) -> List[int]:
    """The hosts this one dials: every other host up to FULL_MESH_MAX_HOSTS, else its
    ring neighbours."""
    if hosts <= FULL_MESH_MAX_HOSTS:
        return [h for h in range(hosts) if h != host]
    return sorted({(host + 1) % hosts, (host - 1) % hosts})


def sources(hosts: int, host: int) -> List[int]:
    """The hosts that dial this one (the plan is symmetric)."""
    return targets(hosts, host)


def reccl_env(**overrides: str) -> Dict[str, str]:
    """This process's RECCL_* settings with ``overrides``: a transport over chosen NICs."""
    import os

    env = {k: v for k, v in os.environ.items() if k.startswith("RECCL_")}
    env.update(overrides)
    return env


# ---------------------------------------------------------------- plain TCP


class EchoServer:
    """A listening socket on each rail address; one thread echoes whatever arrives."""

    def __init__(self, addresses: List[Optional[str]]):
        self._selector = selectors.DefaultSelector()
        self.ports: List[Optional[int]] = []
        self.errors: List[Optional[str]] = []
        for address in addresses:
            if address is None:
                self.ports.append(None)
                self.errors.append("no NIC on this rail")
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((address, 0))
                s.listen(64)
            except OSError as error:
                s.close()
                self.ports.append(None)
                self.errors.append(f"cannot listen on {address}: {error.strerror or error}")
                continue
            s.setblocking(False)
            self._selector.register(s, selectors.EVENT_READ, "listen")
            self.ports.append(s.getsockname()[1])
            self.errors.append(None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reccl-qualify-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                sock = key.fileobj
                if key.data == "listen":
                    try:
                        conn, _ = sock.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._selector.register(conn, selectors.EVENT_READ, "echo")
                    continue
                try:
                    data = sock.recv(4096)
                    if data:
                        sock.send(data)  # a few bytes at a time: the socket buffer takes them
                        continue
                except OSError:
                    pass
                self._selector.unregister(sock)
                sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()


def _tcp_error(code: int) -> str:
    import os

    return os.strerror(code) if code else "unknown error"


def tcp_probes(pairs: List[Tuple[Any, str, str, int]], deadline: float, rounds: int = ROUNDS
               ) -> Dict[Any, Dict[str, Any]]:
    """Connects every (key, local address, peer address, peer port) at once, then echoes
    ``rounds`` pings on each that connected: key -> {connected, rtt_us, error}."""
    out: Dict[Any, Dict[str, Any]] = {}
    selector = selectors.DefaultSelector()
    pending = {}
    for key, local, peer, port in pairs:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((local, 0))
            s.setblocking(False)
            code = s.connect_ex((peer, port))
        except OSError as error:
            s.close()
            out[key] = {"connected": False, "rtt_us": None,
                        "error": f"from {local} to {peer}:{port}: {error.strerror or error}"}
            continue
        if code not in (0, 115):  # 115: EINPROGRESS
            s.close()
            out[key] = {"connected": False, "rtt_us": None,
                        "error": f"from {local} to {peer}:{port}: {_tcp_error(code)}"}
            continue
        selector.register(s, selectors.EVENT_WRITE, key)
        pending[key] = (s, local, peer, port)
    connected = []
    while pending and time.monotonic() < deadline:
        for skey, _ in selector.select(timeout=max(0.0, min(0.2, deadline - time.monotonic()))):
            key = skey.data
            s, local, peer, port = pending.pop(key)
            selector.unregister(s)
            code = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                s.close()
                out[key] = {"connected": False, "rtt_us": None,
                            "error": f"from {local} to {peer}:{port}: {_tcp_error(code)}"}
            else:
                connected.append((key, s, local, peer, port))
    for key, (s, local, peer, port) in pending.items():
        selector.unregister(s)
        s.close()
        out[key] = {"connected": False, "rtt_us": None,
                    "error": f"from {local} to {peer}:{port}: no answer to the connect within the deadline"}
    selector.close()
    for key, s, local, peer, port in connected:
        try:
            s.setblocking(True)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(max(0.5, deadline + PING_SLACK_S - time.monotonic()))
            rtts = []
            for i in range(rounds):
                begin = time.perf_counter()
                s.sendall(struct.pack("<q", i))
                got = b""
                while len(got) < PING:
                    chunk = s.recv(PING - len(got))
                    if not chunk:
                        raise OSError("the peer closed the connection")
                    got += chunk
                rtts.append(time.perf_counter() - begin)
            out[key] = {"connected": True, "rtt_us": round(statistics.median(rtts) * 1e6, 1), "error": None}
        except OSError as error:
            out[key] = {"connected": True, "rtt_us": None,
                        "error": f"connected from {local} to {peer}:{port}, then the echo failed: {error}"}
        finally:
            s.close()
    return out


# ---------------------------------------------------------------- reccl transports


class RailListeners:
    """One reccl transport per rail, each over that rail's NIC alone, listening."""

    def __init__(self, make: Callable[[int], Any], rails: int):
        self.transports: List[Any] = []
        self.listeners: List[Any] = []
        self.errors: List[Optional[str]] = []
        for rail in range(rails):
            try:
                transport = make(rail)
                listener = transport.listen(0)
            except Exception as error:  # noqa: BLE001 - ConfigError, RecclError: reported per rail
                self.transports.append(None)
                self.listeners.append(None)
                self.errors.append(f"{type(error).__name__}: {error}")
                continue
            self.transports.append(transport)
            self.listeners.append(listener)
            self.errors.append(None)

    def handles(self) -> List[Optional[str]]:
        return [base64.b64encode(bytes(listener.handle)).decode() if listener is not None else None
                for listener in self.listeners]

    def close(self) -> None:
        for listener in self.listeners:
            if listener is not None:
                listener.close()
        self.listeners = []
        self.transports = []


def _paths_text(connection) -> str:
    try:
        return "; ".join(connection.paths())
    except Exception:  # noqa: BLE001 - a closed connection
        return "?"


def dial(rails: RailListeners, outbound: List[Tuple[int, int, str]], inbound_expected: Dict[int, int],
         deadline: float, rounds: int = ROUNDS) -> Dict[Tuple[int, int], Dict[str, Any]]:
    """Dials every (target host, rail, peer handle) in ``outbound`` and accepts
    ``inbound_expected[rail]`` connections on each rail's listener, all by ``deadline``;
    then pings each outbound connection ``rounds`` times (the peer's receives are posted
    as it accepts). (target, rail) -> {ok, rtt_us, error}."""
    out: Dict[Tuple[int, int], Dict[str, Any]] = {}
    sends = {}
    for target, rail, handle in outbound:
        transport = rails.transports[rail]
        try:
            sends[(target, rail)] = transport.connect(0, base64.b64decode(handle))
        except Exception as error:  # noqa: BLE001 - a handle this build cannot read
            out[(target, rail)] = {"ok": False, "rtt_us": None, "error": f"{type(error).__name__}: {error}"}
    accepted: List[Tuple[Any, List[Any], List[bytearray]]] = []
    waiting = {rail: count for rail, count in inbound_expected.items()
               if count > 0 and rails.listeners[rail] is not None}
    ping_deadline = deadline + PING_SLACK_S
    while time.monotonic() < deadline:
        for rail in list(waiting):
            try:
                connection = rails.listeners[rail].accept(ACCEPT_POLL_S)
            except TimeoutError:
                continue
            buffers = [bytearray(PING) for _ in range(rounds + 1)]
            accepted.append((connection, [connection.irecv(b) for b in buffers], buffers))
            waiting[rail] -= 1
            if waiting[rail] == 0:
                del waiting[rail]
        if not waiting and all(c.ready or c.error for c in sends.values()):
            break
        if not waiting:
            time.sleep(ACCEPT_POLL_S)
    for key, connection in sends.items():
        try:
            connection.wait_ready(max(0.001, deadline - time.monotonic()))
            connection.isend(struct.pack("<q", key[0])).wait(max(0.001, ping_deadline - time.monotonic()))
            rtts = []
            for i in range(rounds):
                begin = time.perf_counter()
                connection.isend(struct.pack("<q", i)).wait(max(0.001, ping_deadline - time.monotonic()))
                rtts.append(time.perf_counter() - begin)
            out[key] = {"ok": True, "rtt_us": round(statistics.median(rtts) * 1e6, 1), "error": None}
        except Exception as error:  # noqa: BLE001 - TimeoutError, RecclError: the row says which
            text = str(error)
            if "paths:" not in text:
                text += f"; paths: {_paths_text(connection)}"
            out[key] = {"ok": False, "rtt_us": None, "error": text}
    for connection, requests, _ in accepted:
        for request in requests:
            try:
                request.wait(max(0.001, ping_deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - the dialer reports its own failure
                break
        connection.close()
    for connection in sends.values():
        connection.close()
    return out


def tcp_transport_maker(addresses: List[str]) -> Callable[[int], Any]:
    from torch_reccl.transport import Transport

    return lambda rail: Transport(reccl_env(RECCL_NICS=addresses[rail]))


def verbs_rails() -> Tuple[List[str], Optional[str]]:
    """The RDMA devices reccl's IB transport would use, in rail order, or why none."""
    from torch_reccl._native import native

    c = native()
    loaded = c.ib_load_system_verbs()
    if not loaded["loaded"]:
        return [], f"libibverbs does not load: {loaded['error']}"
    if not loaded["devices"]:
        return [], "libibverbs lists no RDMA device"
    try:
        env = reccl_env()
        transport = c.IbTransport(None, env, c.ib_bootstrap_address(env))
        return [nic["name"] for nic in transport.nics()], None
    except Exception as error:  # noqa: BLE001 - ConfigError: no active port, ...
        return [], f"{type(error).__name__}: {error}"


def verbs_transport_maker(devices: List[str]) -> Callable[[int], Any]:
    from torch_reccl._native import native

    c = native()

    def make(rail: int):
        env = reccl_env(RECCL_IB_HCA=devices[rail])
        return c.IbTransport(None, env, c.ib_bootstrap_address(env))

    return make
