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
import time

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


def test_a_live_peer_that_gives_up_on_a_nic_is_not_condemned_while_our_other_nic_is_down():
    """The soak's false verdict: the receiver's primary NIC is down, and the live
    sender gives up on its backup NIC (here an injected fault, in the soak a NIC it
    found slow), which ends the backup path with an end of stream and sends no
    redial there. The receiver then saw only "the peer's host answered" and failed
    the connection after RECCL_PEER_GONE_TIMEOUT_MS. A live listener refuses no
    connect, so nothing here is evidence of a dead process: the connection waits
    (stalled) and carries on once a NIC is back."""
    from conftest import Fabric, heal_all, stream

    bed = Fabric("tcp", PEER_GONE_TIMEOUT_MS=1000, NO_PATH_TIMEOUT_MS=30000)
    try:
        send, recv = bed.pair(nic=0)
        stream(send, recv, [1 << 16] * 8, seed=1)
        bed.link(bed.nics_b[0], up=False)  # the receiver's primary: a local NIC down
        bed.link(bed.nics_a[1], up=False)  # the sender closes its backup's path
        time.sleep(4.0)  # four times the bound
        assert recv.error == "" and send.error == "", (recv.error, send.error)
        bed.link(bed.nics_b[0], up=True)
        stream(send, recv, [1 << 16] * 8, seed=2)
        assert recv.error == "" and send.error == ""
    finally:
        heal_all()
        bed.close()
