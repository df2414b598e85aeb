"""Which NIC pairs a connection uses: same rail for the primary, backup to backup."""
import time

import pytest

from torch_reccl.transport import Transport

NICS = {"RECCL_NICS": "127.0.0.1,127.0.0.2,127.0.0.3", "RECCL_HEARTBEAT_MS": "300"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("listen_nic", [0, 1, 2])
def test_primary_stays_on_the_senders_rail(listen_nic):
    transport = Transport(NICS)
    listener = transport.listen(listen_nic)
    send = transport.connect(0, listener.handle)
    send.wait_ready(10)
    recv = listener.accept(10)
    # wait_ready() returns once the primary is active; the backup may still dial.
    deadline = time.monotonic() + 10
    while "dialing" in send.paths()[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    paths = send.paths()
    # Rail 0 to the peer's rail 0, whatever NIC the peer listened on; the backup
    # is our NIC 0's backup (the next NIC: no PCI topology on loopback) on both ends.
    assert paths[0].startswith("primary lo:127.0.0.1->127.0.0.1/nic0"), paths
    assert paths[1].startswith("backup lo:127.0.0.2->127.0.0.2/nic1"), paths
    assert send.active_path == 0
    data = bytearray(4)
    request = recv.irecv(data)
    send.isend(b"rail").wait(10)
    assert request.wait(10) == 4 and bytes(data) == b"rail"
    send.close()
    recv.close()
    listener.close()
