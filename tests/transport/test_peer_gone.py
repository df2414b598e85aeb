"""What counts as "the peer's host answered for the peer with nothing there".

A connection fails fast (RECCL_PEER_GONE_TIMEOUT_MS) instead of waiting out an
outage (RECCL_NO_PATH_TIMEOUT_MS) only on that evidence, so it must never come
from a live process. A handshake whose TCP connect succeeded reached a live
listener, whatever the listener then does: it may close the socket (a NIC it
considers down, an unknown connection) or reset it (too many handshakes at once,
a handshake past its deadline). Only a refused connect (nothing listens on the
port) is the host answering for a dead process. Under random combined faults a
live peer's listener did reset handshakes, and its neighbours condemned it as
gone; the raw listeners below play each answer.
"""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from conftest import testing as load_testing


def serve_once(behaviour: str):
    """A listener on 127.0.0.1 that answers one connection as told; (port, thread)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(10.0)

    def run():
        with server:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                if behaviour == "reset":
                    # close with the HELLO unread and a zero linger: a reset
                    conn.recv(1)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif behaviour == "close":
                    conn.settimeout(5.0)
                    try:
                        while conn.recv(4096):
                            pass
                    except OSError:
                        pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


def closed_port() -> int:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: a connect is refused
    return port


@pytest.fixture(scope="module")
def testing():
    return load_testing()


def test_a_refused_connect_is_the_peers_host_answering_for_a_dead_process(testing):
    out = testing.dial_with_hello("127.0.0.1", "127.0.0.1", closed_port(), 2000)
    assert not out["connected"]
    assert "Connection refused" in out["what"]
    assert out["peer_host_answered"] is True


@pytest.mark.parametrize("behaviour", ["reset", "close"])
def test_a_listener_that_accepted_then_reset_or_closed_is_a_live_process(testing, behaviour):
    port, thread = serve_once(behaviour)
    out = testing.dial_with_hello("127.0.0.1", "127.0.0.1", port, 5000)
    thread.join(10.0)
    assert not out["connected"]
    assert out["what"].startswith("handshake with 127.0.0.1")
    assert out["peer_host_answered"] is False, out
