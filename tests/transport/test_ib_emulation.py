"""The verbs emulation itself: the RC semantics the IB transport tests rely on.

Raw QPs, CQs and MRs of ``_testing.IbEmulation`` (``emu.open(device)``), driven
directly: the QP state machine, in-order RDMA writes and write-with-immediate
completions, SEND into posted receives, lkey/rkey and bounds checks, the error
state and its flushes, retry-exceeded after 4.096 us * 2^timeout * (retry + 1)
when a port is down or blackholed, port events with the GID table rebuilt on
a flap, and completion channels (one event per arm). If these did not hold,
test_ib_transport.py would prove little.
"""
from __future__ import annotations

import gc
import select
import time

import numpy as np
import pytest

from torch_reccl._native import testing as emulations
from torch_reccl.transport import ConfigError, RecclError

from nccl_net_harness import DmaBufArena

_testing = emulations()  # ib_select_gid

pytestmark = [pytest.mark.timeout(30)]


def roce_v2_ipv4_index(device):
    return _testing.ib_select_gid(device.gid_table())


class Pair:
    """Two connected RC QPs on devices x and y, each with send/recv CQs and a
    64 KiB buffer registered for remote write."""

    def __init__(self, timeout=10, retry=1, max_send=16, channel=False, send_cq_depth=64, psn_x=0, psn_y=0,
                 y_expects_psn=None):
        self.emu = emulations().IbEmulation(["x", "y"])
        self.x, self.y = self.emu.open("x"), self.emu.open("y")
        self.bx, self.by = bytearray(65536), bytearray(65536)
        self.mx = self.x.register(self.bx, remote_write=True)
        self.my = self.y.register(self.by, remote_write=True)
        # With `channel`, y's two CQs announce completions on one channel, as
        # an IB path's do.
        self.channel = self.y.create_channel() if channel else None
        self.sx, self.rx = self.x.create_cq(depth=send_cq_depth), self.x.create_cq()
        self.sy, self.ry = self.y.create_cq(self.channel), self.y.create_cq(self.channel)
        self.qx = self.x.create_qp(self.sx, self.rx, max_send=max_send)
        self.qy = self.y.create_qp(self.sy, self.ry, max_send=max_send)
        gx, gy = roce_v2_ipv4_index(self.x), roce_v2_ipv4_index(self.y)
        for qp in (self.qx, self.qy):
            qp.to_init()
        # y_expects_psn: what y is told x's PSN is (a wrong one models a bad exchange).
        self.qx.to_rtr(self.qy.qp_number, self.y.gid_table()[gy][0], gx, peer_psn=psn_y)
        self.qy.to_rtr(self.qx.qp_number, self.x.gid_table()[gx][0], gy,
                       peer_psn=psn_x if y_expects_psn is None else y_expects_psn)
        self.qx.to_rts(timeout, retry, psn=psn_x)
        self.qy.to_rts(timeout, retry, psn=psn_y)


def poll_until(cq, count, timeout=5.0):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        out += cq.poll()
        time.sleep(0.001)
    return out


def test_qp_state_machine_rejects_illegal_transitions_and_posts():
    emu = emulations().IbEmulation(["x"])
    x = emu.open("x")
    cq = x.create_cq()
    qp = x.create_qp(cq, cq)
    buf = bytearray(64)
    mr = x.register(buf)
    with pytest.raises(RecclError, match="post_recv on a QP in RESET"):
        qp.post_recv(mr, 0, 64)
    with pytest.raises(RecclError, match="invalid QP transition RESET->RTS"):
        qp.to_rts(10, 1)
    qp.to_init()
    with pytest.raises(RecclError, match="post_send on a QP in INIT"):
        qp.post_send("send", mr, 0, 8)
    with pytest.raises(RecclError, match="GID index 15 is empty"):
        qp.to_rtr(0x999, b"\x00" * 16, 15)
    with pytest.raises(RecclError, match="invalid QP transition INIT->INIT"):
        qp.to_init()
    with pytest.raises(ConfigError, match="outside the registered"):
        qp.post_recv(mr, 60, 8)


def test_writes_land_in_order_and_immediates_complete_receives():
    p = Pair()
    src = bytearray(range(256)) * 16  # 4096 bytes
    p.bx[:4096] = src
    p.qy.post_recv(p.my, 0, 0, wr_id=77)
    for i in range(8):  # eight writes to the same 16 bytes: the last one wins
        p.bx[8192 + i * 16: 8192 + i * 16 + 16] = bytes([i]) * 16
        p.qx.post_send("write", p.mx, 8192 + i * 16, 16, p.my.address(100), p.my.rkey, wr_id=i)
    p.qx.post_send("write_imm", p.mx, 0, 4096, p.my.address(1000), p.my.rkey, imm=0xABCD, wr_id=99)
    sends = poll_until(p.sx, 9)
    assert [c["wr_id"] for c in sends] == list(range(8)) + [99]
    assert all(c["status"] == "success" for c in sends)
    assert bytes(p.by[100:116]) == bytes([7]) * 16
    assert bytes(p.by[1000:5096]) == bytes(src)
    recv = poll_until(p.ry, 1)
    assert recv == [{"wr_id": 77, "status": "success", "opcode": "recv_rdma_with_imm",
                     "byte_len": 4096, "imm": 0xABCD, "qp_num": p.qy.qp_number, "vendor_err": 0}]
    counters = p.emu.counters()
    assert counters["writes"] == 9 and counters["writes_with_imm"] == 1


def test_send_fills_the_posted_receive_and_waits_for_one():
    """No receive posted: RNR NAK, retried without bound (rnr_retry = 7), the
    request counted once in rnr_naks (transport tests require none in steady
    state); a receive already posted takes a SEND with no NAK."""
    p = Pair()
    p.bx[:5] = b"hello"
    p.qx.post_send("send", p.mx, 0, 5, wr_id=1)
    time.sleep(0.05)
    assert p.sx.poll() == []
    assert p.emu.counters()["rnr_naks"] == 1
    p.qy.post_recv(p.my, 200, 64, wr_id=5)
    assert poll_until(p.sx, 1)[0]["status"] == "success"
    recv = poll_until(p.ry, 1)[0]
    assert (recv["wr_id"], recv["opcode"], recv["byte_len"]) == (5, "recv", 5)
    assert bytes(p.by[200:205]) == b"hello"
    p.qy.post_recv(p.my, 0, 64, wr_id=6)
    p.qx.post_send("send", p.mx, 0, 5, wr_id=2)
    assert poll_until(p.sx, 1)[0]["status"] == "success"
    assert p.emu.counters()["rnr_naks"] == 1


def test_bad_rkey_or_bounds_is_a_remote_access_error_that_errors_both_qps():
    for rkey_delta, offset in [(1000, 0), (0, 65536 - 8)]:
        p = Pair()
        p.qy.post_recv(p.my, 0, 0, wr_id=3)
        p.qx.post_send("write", p.mx, 0, 64, p.my.address(offset, 0), p.my.rkey + rkey_delta, wr_id=1)
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=2)
        done = poll_until(p.sx, 2)
        assert [(c["wr_id"], c["status"]) for c in done] == [
            (1, "remote access error"), (2, "work request flushed")]
        # The responder went to ERR too: its posted receive is flushed.
        assert poll_until(p.ry, 1)[0]["status"] == "work request flushed"
        assert p.by[:8] == b"\x00" * 8
        assert p.emu.counters()["access_errors"] == 1


def test_error_state_flushes_everything_and_later_posts():
    p = Pair(timeout=18)  # 1 s per try: nothing times out while we look
    for i in range(3):
        p.qx.post_recv(p.mx, 0, 64, wr_id=10 + i)
    p.emu.drop("y", True)  # nothing completes: the requests stay outstanding
    for i in range(3):
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=i)
    p.qx.to_error()
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=3)
    flushed = poll_until(p.sx, 4)
    assert [(c["wr_id"], c["status"]) for c in flushed] == [(i, "work request flushed") for i in range(4)]
    assert [c["wr_id"] for c in poll_until(p.rx, 3)] == [10, 11, 12]
    p.emu.drop("y", False)
    time.sleep(0.05)
    assert p.by[:8] == b"\x00" * 8  # a QP in ERR writes nothing, ever
    assert p.emu.counters()["flushed"] == 7


@pytest.mark.parametrize("fault", ["port_down", "drop_remote"])
def test_undeliverable_requests_fail_with_retry_exceeded_after_the_budget(fault):
    # timeout 12, retry 3: 4.096 us * 4096 * 4 = 67 ms
    p = Pair(timeout=12, retry=3)
    if fault == "port_down":
        p.emu.port_down("x")
    else:
        p.emu.drop("y", True)
    start = time.monotonic()
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=1)
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=2)
    done = poll_until(p.sx, 2)
    elapsed = time.monotonic() - start
    assert [(c["wr_id"], c["status"]) for c in done] == [
        (1, "transport retry counter exceeded"), (2, "work request flushed")]
    assert 0.060 <= elapsed < 2.0
    counters = p.emu.counters()
    assert counters["retry_exceeded"] == 1 and counters["qp_errors"] == 1


def test_port_events_and_a_gid_table_that_moves_on_every_flap():
    p = Pair()
    index = roce_v2_ipv4_index(p.x)
    gid = p.x.gid_table()[index][0]
    p.emu.port_down("x")
    assert p.x.wait_event(1.0) == "port error"
    assert not p.x.port_active()
    p.emu.port_up("x")
    assert p.x.wait_event(1.0) == "GID change"
    assert p.x.wait_event(1.0) == "port active"
    assert p.x.wait_event(0.05) is None
    moved = roce_v2_ipv4_index(p.x)
    assert moved != index and p.x.gid_table()[moved][0] == gid  # same address, new index
    # The old QP still uses the old index, which now holds another GID: its
    # requests are lost (retry exceeded); a QP set up afresh gets through.
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=1)
    assert poll_until(p.sx, 1, timeout=15)[0]["status"] == "transport retry counter exceeded"
    fresh = Pair()
    fresh.emu.port_down("x")
    fresh.emu.port_up("x")
    q = fresh.x.create_qp(fresh.sx, fresh.rx)
    r = fresh.y.create_qp(fresh.sy, fresh.ry)
    q.to_init()
    r.to_init()
    gx, gy = roce_v2_ipv4_index(fresh.x), roce_v2_ipv4_index(fresh.y)
    q.to_rtr(r.qp_number, fresh.y.gid_table()[gy][0], gx)
    r.to_rtr(q.qp_number, fresh.x.gid_table()[gx][0], gy)
    q.to_rts(10, 1)
    r.to_rts(10, 1)
    fresh.bx[:4] = b"ping"
    q.post_send("write", fresh.mx, 0, 4, fresh.my.address(0), fresh.my.rkey, wr_id=9)
    assert poll_until(fresh.sx, 1)[0]["status"] == "success"
    assert bytes(fresh.by[:4]) == b"ping"


def test_dmabuf_regions_are_reached_through_the_fd_never_through_their_address():
    """A memfd stands in for a GPU's dma-buf. Its registered address range is
    reserved with no access at all, so any CPU access through it would crash
    this process: the bytes can only move through the emulation's own mapping."""
    p = Pair()
    src, dst = DmaBufArena(3 * 4096, "emu-src"), DmaBufArena(3 * 4096, "emu-dst")
    src.host[:] = np.frombuffer(bytes(range(256)) * 48, np.uint8)
    # Registered from the second page of the fd on: address 0 of the region is
    # byte 4096 of the fd.
    msrc = p.x.register_dmabuf(src.fd, 4096, 8192, src.device)
    mdst = p.y.register_dmabuf(dst.fd, 0, 12288, dst.device)
    assert msrc.address(0) == src.device
    p.qy.post_recv(p.my, 0, 0, wr_id=1)
    p.qx.post_send("write", msrc, 0, 8192, mdst.address(100), mdst.rkey, wr_id=1)
    p.bx[:64] = b"\x5a" * 64
    p.qx.post_send("write_imm", p.mx, 0, 64, mdst.address(9000), mdst.rkey, imm=3, wr_id=2)
    assert [c["status"] for c in poll_until(p.sx, 2)] == ["success", "success"]
    assert poll_until(p.ry, 1)[0]["imm"] == 3
    assert bytes(dst.host[100:8292]) == bytes(src.host[4096:12288])
    assert bytes(dst.host[9000:9064]) == b"\x5a" * 64
    # A dma-buf region has bounds like any other.
    p2 = Pair()
    m = p2.y.register_dmabuf(dst.fd, 0, 4096, dst.device)
    p2.qx.post_send("write", p2.mx, 0, 64, m.address(4096 - 32, 0), m.rkey, wr_id=9)
    assert poll_until(p2.sx, 1)[0]["status"] == "remote access error"


def test_dmabuf_and_gpu_pointer_registration_errors_are_clear():
    """rdma-core's rules for ibv_reg_dmabuf_mr: the range lies inside the
    dma-buf, and iova sits at the same offset within a page as `offset` (the
    NIC maps whole pages); an unaligned offset with a matching iova is fine."""
    emu = emulations().IbEmulation(["x"])
    x = emu.open("x")
    arena = DmaBufArena(8192, "emu-bad")
    assert x.register_dmabuf(arena.fd, 100, 4096, arena.device + 100).address(0) == arena.device + 100
    with pytest.raises(RecclError, match="offset 100 and iova .* different offsets within a 4096-byte page"):
        x.register_dmabuf(arena.fd, 100, 4096, arena.device)
    with pytest.raises(RecclError, match=r"\[4096, \+8192\) lies beyond the dma-buf's 8192 bytes"):
        x.register_dmabuf(arena.fd, 4096, 8192, arena.device)
    with pytest.raises(RecclError, match="fd -1 is not a dma-buf"):
        x.register_dmabuf(-1, 0, 4096, arena.device)
    with pytest.raises(RecclError, match="cannot register GPU memory by pointer"):
        x.register_gpu_pointer(arena.device, 4096)


def test_an_unaligned_dmabuf_offset_reaches_the_right_bytes():
    p = Pair()
    arena = DmaBufArena(3 * 4096, "emu-unaligned")
    region = p.y.register_dmabuf(arena.fd, 4196, 4000, arena.device + 4196)
    p.bx[:32] = b"\x77" * 32
    p.qx.post_send("write", p.mx, 0, 32, region.address(10), region.rkey, wr_id=1)
    assert poll_until(p.sx, 1)[0]["status"] == "success"
    assert bytes(arena.host[4206:4238]) == b"\x77" * 32 and not arena.host[:4206].any()


def test_send_queue_slots_free_only_when_their_completion_is_polled():
    """A send-queue slot is not free when its request executes but when its
    completion, or a later one's (an unsignaled request has none), is polled."""
    p = Pair(max_send=4)
    for i in range(4):
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(8 * i), p.my.rkey, wr_id=i)
    deadline = time.monotonic() + 5
    while p.emu.counters()["writes"] < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert p.emu.counters()["writes"] == 4  # all executed ...
    with pytest.raises(RecclError, match="send queue full: 4 requests whose completions were not polled"):
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=9)  # ... none polled
    assert len(p.sx.poll(max=1)) == 1
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=4)  # one slot back
    assert len(poll_until(p.sx, 4)) == 4
    # Three unsignaled writes and a signaled one: the last one's completion frees all four.
    for i in range(3):
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=20 + i, signaled=False)
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=23)
    time.sleep(0.05)
    with pytest.raises(RecclError, match="send queue full"):
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=24)
    assert [c["wr_id"] for c in poll_until(p.sx, 1)] == [23]
    for i in range(4):
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=30 + i)
    assert len(poll_until(p.sx, 4)) == 4


def test_a_completion_queue_that_overruns_is_lost_with_its_queue_pairs():
    """More completions than the CQ's depth: CQ_ERR, polling it fails (< 0) and
    its QPs go to ERR (their requests are flushed, so nothing more lands)."""
    p = Pair(send_cq_depth=2, max_send=8)
    for i in range(3):
        p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=i)
    assert p.x.wait_event(2.0) == "CQ error"
    with pytest.raises(RecclError, match="ibv_poll_cq failed .* overran its 2 entries"):
        p.sx.poll()
    assert p.emu.counters()["cq_overruns"] == 1
    p.bx[:8] = b"late!!!!"
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(100), p.my.rkey, wr_id=7)
    time.sleep(0.05)
    assert p.by[100:108] == b"\x00" * 8  # the QP is in ERR: nothing of it lands


def test_packet_sequence_numbers_must_match():
    """The responder takes only the PSN it was told to expect (rq_psn): a QP
    whose sq_psn differs gets nothing through (retry exceeded); equal non-zero
    PSNs work, compared in their 24 bits."""
    good = Pair(psn_x=0x123456, psn_y=0xABCDEF, y_expects_psn=0x1123456)  # 24 bits: the same
    good.qx.post_send("write", good.mx, 0, 8, good.my.address(0), good.my.rkey, wr_id=1)
    assert poll_until(good.sx, 1)[0]["status"] == "success"
    bad = Pair(timeout=12, retry=1, psn_x=7, y_expects_psn=8)
    bad.qx.post_send("write", bad.mx, 0, 8, bad.my.address(0), bad.my.rkey, wr_id=1)
    assert poll_until(bad.sx, 1)[0]["status"] == "transport retry counter exceeded"


def test_error_completions_are_valid_only_in_wr_id_status_qp_num_and_vendor_err():
    p = Pair()
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=5)
    ok = poll_until(p.sx, 1)[0]
    assert (ok["wr_id"], ok["status"], ok["qp_num"], ok["opcode"], ok["byte_len"]) == (
        5, "success", p.qx.qp_number, "rdma_write", 8)
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey + 99, wr_id=6)
    bad = poll_until(p.sx, 1)[0]
    assert (bad["wr_id"], bad["status"], bad["qp_num"]) == (6, "remote access error", p.qx.qp_number)
    # The rest is garbage, as ibv_poll_cq(3) allows: nothing may read it.
    assert bad["byte_len"] == 0xDEADBEEF and bad["imm"] == 0xBADC0DE


def test_held_requests_land_late_unless_the_responder_was_fenced():
    """hold() models packets in flight: the request leaves its QP with the bytes
    it read then and completes only when it lands. Moving the *requester* to ERR
    does not recall it; a responder in ERR drops it."""
    p = Pair()
    p.bx[:16] = b"A" * 16
    p.emu.hold("x")
    p.qx.post_send("write", p.mx, 0, 16, p.my.address(0), p.my.rkey, wr_id=1)
    assert poll_until(p.sx, 1, timeout=0.2) == []  # on the wire, not acknowledged
    p.bx[:16] = b"B" * 16  # too late: the request read its bytes when it left
    assert p.emu.counters()["held"] == 1 and p.by[:16] == b"\x00" * 16
    p.emu.hold("x", False)
    assert poll_until(p.sx, 1)[0]["status"] == "success"
    assert p.by[:16] == b"A" * 16 and p.emu.counters()["wire_delivered"] == 1

    # Requester fenced, responder not: the write still lands (its sender saw it flushed).
    p.emu.hold("x")
    p.qx.post_send("write", p.mx, 0, 16, p.my.address(16), p.my.rkey, wr_id=2)
    assert wait_held(p.emu, 2)
    p.qx.to_error()
    assert poll_until(p.sx, 1)[0]["status"] == "work request flushed"
    p.emu.hold("x", False)
    assert p.by[16:32] == b"B" * 16 and p.emu.counters()["wire_delivered"] == 2

    # Responder fenced: dropped.
    q = Pair()
    q.bx[:16] = b"C" * 16
    q.emu.hold("x")
    q.qx.post_send("write", q.mx, 0, 16, q.my.address(0), q.my.rkey, wr_id=3)
    assert wait_held(q.emu, 1)
    q.qy.to_error()
    q.emu.hold("x", False)
    counters = q.emu.counters()
    assert counters["wire_dropped"] == 1 and counters["wire_delivered"] == 0
    assert q.by[:16] == b"\x00" * 16


def wait_held(emu, count, timeout=2.0):
    deadline = time.monotonic() + timeout
    while emu.counters()["held"] < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_rdma_read_needs_remote_read_rights():
    """RDMA READ (the GPU flush): granted on dma-buf regions, refused on regions
    registered for remote write only."""
    p = Pair()
    arena = DmaBufArena(8192, "emu-read")
    arena.host[:] = np.arange(8192, dtype=np.uint32).astype(np.uint8)
    region = p.y.register_dmabuf(arena.fd, 0, 8192, arena.device)
    p.qx.post_send("read", p.mx, 0, 16, region.address(100), region.rkey, wr_id=1)
    done = poll_until(p.sx, 1)[0]
    assert (done["status"], done["opcode"]) == ("success", "rdma_read")
    assert bytes(p.bx[:16]) == bytes(arena.host[100:116])
    assert p.emu.counters()["reads"] == 1
    p.qx.post_send("read", p.mx, 0, 16, p.my.address(0), p.my.rkey, wr_id=2)
    assert poll_until(p.sx, 1)[0]["status"] == "remote access error"
    assert p.emu.counters()["reads"] == 1


def readable(fd, timeout):
    return bool(select.select([fd], [], [], timeout)[0])


def test_a_completion_channel_raises_one_event_per_arm():
    """What an IB path sleeps on (docs/ib.md): an armed CQ raises one event on
    its channel at its next completion and then stays quiet until re-armed; an
    unarmed CQ raises none, nor do completions already in it when it is armed.
    So a path must take the event, re-arm, and only then poll."""
    p = Pair(channel=True)
    fd = p.channel.fd
    for i in range(6):
        p.qy.post_recv(p.my, i * 64, 64, wr_id=i)

    def send_to_y(wr_id):
        p.qx.post_send("send", p.mx, 0, 8, wr_id=wr_id)
        assert poll_until(p.sx, 1)[0]["status"] == "success"

    send_to_y(1)  # unarmed: the completion is there, no event
    assert not readable(fd, 0.1)
    assert p.channel.take_event() is None  # non-blocking: nothing waits
    p.ry.arm()
    assert not readable(fd, 0.1)  # what was in the CQ before the arm raises nothing
    send_to_y(2)
    assert readable(fd, 2.0)
    assert p.channel.take_event() is p.ry
    assert not readable(fd, 0.05) and p.channel.take_event() is None
    assert [c["wr_id"] for c in poll_until(p.ry, 2)] == [0, 1]
    send_to_y(3)  # not re-armed: no event, though the completion is there
    assert not readable(fd, 0.1)
    assert [c["wr_id"] for c in poll_until(p.ry, 1)] == [2]
    p.ry.arm()
    p.ry.arm()  # arming an armed CQ changes nothing: still one event
    send_to_y(4)
    send_to_y(5)
    assert readable(fd, 2.0)
    assert p.channel.take_event() is p.ry
    assert p.channel.take_event() is None
    assert [c["wr_id"] for c in poll_until(p.ry, 2)] == [3, 4]

    # Both CQs on one channel: each event names its CQ.
    p.ry.arm()
    p.sy.arm()
    p.qx.post_recv(p.mx, 0, 64, wr_id=9)
    p.qy.post_send("send", p.my, 0, 8, wr_id=8)
    assert poll_until(p.sy, 1)[0]["wr_id"] == 8
    assert readable(fd, 2.0)
    assert p.channel.take_event() is p.sy
    assert p.channel.take_event() is None  # the armed ry saw nothing

    # Moving the QP to ERR flushes its receives: completions like any other.
    p.qy.to_error()
    assert readable(fd, 2.0)
    assert p.channel.take_event() is p.ry
    assert [c["status"] for c in poll_until(p.ry, 1)] == ["work request flushed"]


def test_events_of_a_destroyed_cq_go_with_it():
    p = Pair(channel=True)
    p.qy.post_recv(p.my, 0, 64, wr_id=1)
    p.ry.arm()
    p.qx.post_send("send", p.mx, 0, 8, wr_id=1)
    assert readable(p.channel.fd, 2.0)
    del p.qy, p.ry  # the QP keeps its CQs alive
    gc.collect()
    assert not readable(p.channel.fd, 0.05)
    assert p.channel.take_event() is None


def test_arming_needs_a_completion_channel():
    p = Pair()
    with pytest.raises(RecclError, match="without a completion channel"):
        p.ry.arm()


def test_a_fatal_device_error_kills_its_contexts_for_good():
    """DEVICE_FATAL: the event reaches the open contexts, the device's QPs go to
    ERR (outstanding work flushed), every verbs call on those contexts fails
    (EIO) even after the device is back, opening it fails until it is back, and
    a context opened after that works; the old contexts hear no more events."""
    p = Pair()
    p.qy.post_recv(p.my, 0, 64, wr_id=5)
    p.emu.device_fatal("y")
    assert p.y.wait_event(1.0) == "device fatal"
    assert [c["status"] for c in poll_until(p.ry, 1)] == ["work request flushed"]
    with pytest.raises(RecclError, match=r"ibv_reg_mr on y: the device had a fatal error.*\(EIO\)"):
        p.y.register(bytearray(64))
    with pytest.raises(RecclError, match=r"ibv_open_device: y is gone after a fatal error \(ENODEV\)"):
        p.emu.open("y")
    p.qx.post_send("write", p.mx, 0, 8, p.my.address(0), p.my.rkey, wr_id=6)
    assert poll_until(p.sx, 1)[0]["status"] == "transport retry counter exceeded"
    p.emu.recover_device("y")
    with pytest.raises(RecclError, match="ibv_create_cq on y: the device had a fatal error"):
        p.y.create_cq()
    fresh = p.emu.open("y")
    assert fresh.port_active()
    fresh.register(bytearray(64))
    p.emu.port_down("y")
    assert fresh.wait_event(1.0) == "port error"
    assert p.y.wait_event(0.1) is None

