"""Tests of the emulated rail-optimized fabric (torch_reccl.fabric, docs/design.md §11).

Needs root (network namespaces); skipped otherwise. Every test builds its own
fabric with a unique name and has a SIGALRM guard; the file runs in ~20 s.
"""
from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import time

import pytest

from torch_reccl.fabric import Fabric, FabricError, fabric as fabric_mod, require_root

from conftest import REPO

TEST_TIMEOUT_S = 40
PORT = 47011

# echo server: accept forever, answer every connection with one byte
SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(64)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.sendall(b"x")
    finally:
        c.close()
"""

# TCP probe: rc 0 and "ok" when a connection + 1 byte round trip works
PROBE = r"""
import socket, sys
ip, port, t = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    s = socket.create_connection((ip, port), timeout=t)
    s.settimeout(t)
    assert s.recv(1) == b"x"
    print("ok")
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(1)
"""

# which local address does the kernel pick to reach argv[1]?
SRCADDR = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], 9))
print(s.getsockname()[0])
"""

# netlink listener: print flags of every RTM_NEWLINK for argv[1]
LINKMON = r"""
import os, select, socket, struct, sys, time
idx = socket.if_nametoindex(sys.argv[1])
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
s.bind((0, 1))  # RTMGRP_LINK
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
seen_down = False
while time.monotonic() < deadline:
    r, _, _ = select.select([s], [], [], 0.1)
    if not r:
        continue
    data = s.recv(65536)
    off = 0
    while off + 32 <= len(data):
        ln, typ = struct.unpack_from("=IH", data, off)
        if typ == 16:  # RTM_NEWLINK
            _, _, _, index, flags, _ = struct.unpack_from("=BBHiII", data, off + 16)
            if index == idx:
                lower, running = bool(flags & 0x10000), bool(flags & 0x40)
                print(f"lower_up={int(lower)} running={int(running)}", flush=True)
                seen_down = seen_down or not lower
                if seen_down and lower and running:
                    sys.exit(0)
        off += (ln + 3) & ~3
        if ln == 0:
            break
sys.exit(3)
"""

# iperf-like: receiver measures steady-state bytes/s after a short warm-up
RECEIVER = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1)
s.settimeout(10)
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(10)
warm = float(sys.argv[2])
buf = bytearray(1 << 20)
n = 0
t0 = tw = None
nw = 0
while True:
    k = c.recv_into(buf)
    if not k:
        break
    now = time.monotonic()
    if t0 is None:
        t0 = now
    n += k
    if now - t0 <= warm:
        nw, tw = n, now
print((n - nw) / (now - tw))
"""

SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
b = b"\0" * (1 << 18)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(b)
c.close()
"""


@pytest.fixture(autouse=True)
def _timeout_guard():
    """SIGALRM guard per test; coexists with pytest-timeout's (longer) alarm,
    which it puts back afterwards."""
    old_left, _ = signal.getitimer(signal.ITIMER_REAL)
    if old_left and old_left <= TEST_TIMEOUT_S:
        yield  # an outer alarm is already tighter
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded its {TEST_TIMEOUT_S}s guard")

    t0 = time.monotonic()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if old_left:
            signal.setitimer(signal.ITIMER_REAL,
                             max(0.001, old_left - (time.monotonic() - t0)))


@pytest.fixture
def root():
    require_root()


def _unique_name(tag: str) -> str:
    """tag + random chars, 4 chars in all, not used by any fabric now."""
    for _ in range(100):
        name = tag + "".join(random.choices(string.ascii_lowercase + string.digits,
                                            k=4 - len(tag)))
        if not _leftovers(name)[0] and not _leftovers(name)[1] \
                and not os.path.exists(fabric_mod._state_path(name)):
            return name
    raise RuntimeError("no free fabric name")


def _leftovers(name: str):
    """(netns, root links) that still carry fabric ``name``, seen by pyroute2."""
    from pyroute2 import IPRoute, netns

    ns = [n for n in netns.listnetns() if n.startswith(f"reccl-{name}-")]
    with IPRoute() as ipr:
        links = [link.get("ifname") for link in ipr.get_links()
                 if (link.get("ifname") or "").startswith(f"rc{name}-")]
    return ns, links


@pytest.fixture
def make_fabric(root):
    made = []

    def make(tag, hosts=2, rails=2, rate_mbit=None):
        fab = Fabric(hosts=hosts, rails=rails, rate_mbit=rate_mbit, name=_unique_name(tag))
        made.append(fab)
        return fab.up()

    yield make
    for fab in made:
        fab.down()
        assert _leftovers(fab.name) == ([], [])


def _start(fab, host, script, *args):
    p = fab.popen(host, [sys.executable, "-c", script, *map(str, args)],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import select

    r, _, _ = select.select([p.stdout], [], [], 10)
    line = p.stdout.readline().strip() if r else ""
    if line != "ready":
        p.kill()
        raise AssertionError(f"helper did not start in host {host}: {line!r} "
                             f"{p.communicate(timeout=5)[1]}")
    return p


@pytest.fixture
def server():
    procs = []

    def start(fab, host=1):
        p = _start(fab, host, SERVER, PORT)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait(5)


def probe(fab, src, ip, timeout=1.0) -> bool:
    cp = fab.run(src, [sys.executable, "-c", PROBE, ip, str(PORT), str(timeout)],
                 timeout=timeout + 10)
    return cp.returncode == 0 and cp.stdout.strip() == "ok"


def carrier(fab, host, rail):
    nic = fab.nic_name(rail)
    cp = fab.run(host, ["cat", f"/sys/class/net/{nic}/carrier",
                        f"/sys/class/net/{nic}/operstate"], timeout=10)
    # reading carrier of a down link fails with EINVAL: report it as 0
    lines = cp.stdout.split()
    if len(lines) == 1:
        return 0, lines[0]
    return int(lines[0]), lines[1]


# --------------------------------------------------------------- no root needed
def test_validation_and_names():
    with pytest.raises(ValueError, match="1-4 characters"):
        Fabric(name="toolong")
    with pytest.raises(ValueError, match="1-4 characters"):
        Fabric(name="a-b")
    with pytest.raises(ValueError, match="hosts must be an int in 1..254"):
        Fabric(hosts=0, name="v")
    with pytest.raises(ValueError, match="rails must be an int in 1..256"):
        Fabric(rails=300, name="v")
    with pytest.raises(ValueError, match="rate_mbit"):
        Fabric(rate_mbit=-5, name="v")
    with pytest.raises(ValueError, match="tcp_congestion must be None .* or an algorithm's name"):
        Fabric(tcp_congestion="Cubic;reboot", name="v")
    fab = Fabric(hosts=2, rails=2, name="v1")
    with pytest.raises(ValueError, match=r"host must be an int in 0\.\.1; got 2"):
        fab.nic_ip(2, 0)
    with pytest.raises(ValueError, match=r"rail must be an int in 0\.\.1; got 5"):
        fab.nic_down(0, 5)
    with pytest.raises(ValueError, match=r"rail must be an int in 0\.\.1"):
        fab.nic_name(2)
    assert fab.netns(1) == "reccl-v1-h1"
    assert fab.nic_name(1) == "eth1"
    assert fab.nic_ip(1, 0) == "198.18.0.2"
    assert fab.mgmt_ip(0) == "198.19.0.1"
    # every interface name fits IFNAMSIZ even at the largest sizes
    big = Fabric(hosts=254, rails=256, name="abcd")
    names = [big.port_name(253, 255), big.mgmt_port_name(253), big.rail_bridge(255),
             big.mgmt_bridge]
    assert all(len(n) <= 15 for n in names), names
    assert all(n.startswith("rcabcd-") for n in names)


# --------------------------------------------------------------- topology
def test_connectivity_every_rail_and_mgmt(make_fabric, server):
    fab = make_fabric("c")
    server(fab, 1)
    for r in range(fab.rails):
        assert probe(fab, 0, fab.nic_ip(1, r)), f"rail {r}"
        # traffic for rail r leaves by eth r (source address of that NIC)
        src = fab.run(0, [sys.executable, "-c", SRCADDR, fab.nic_ip(1, r)]).stdout.strip()
        assert src == fab.nic_ip(0, r)
    assert probe(fab, 0, fab.mgmt_ip(1))
    # the host sees its own interfaces in /sys (not the root namespace's)
    ifaces = set(fab.run(0, ["ls", "/sys/class/net"]).stdout.split())
    assert ifaces == {"lo", "eth0", "eth1", "mgmt0"}
    assert carrier(fab, 0, 0) == (1, "up")


def test_nic_down_and_up(make_fabric, server):
    fab = make_fabric("n")
    server(fab, 1)
    mon = _start(fab, 1, LINKMON, "eth0", 8)
    fab.nic_down(1, 0)
    assert carrier(fab, 1, 0) == (0, "down")
    assert carrier(fab, 1, 1) == (1, "up")
    assert carrier(fab, 0, 0) == (1, "up")  # only host 1 lost its link
    assert not probe(fab, 0, fab.nic_ip(1, 0), timeout=0.5)
    assert probe(fab, 0, fab.nic_ip(1, 1))
    assert probe(fab, 0, fab.mgmt_ip(1))
    fab.nic_up(1, 0)
    assert carrier(fab, 1, 0) == (1, "up")
    # the process inside saw netlink link events: lower-up cleared, then set
    out, err = mon.communicate(timeout=10)
    assert mon.returncode == 0, (out, err)
    assert "lower_up=0 running=0" in out and out.rstrip().endswith("lower_up=1 running=1")
    assert probe(fab, 0, fab.nic_ip(1, 0))


def test_rail_down_affects_every_host(make_fabric, server):
    fab = make_fabric("r", hosts=3, rails=2)
    server(fab, 1)
    fab.nic_down(2, 1)
    fab.rail_down(1)
    for h in range(fab.hosts):
        assert carrier(fab, h, 1) == (0, "down"), f"host {h}"
        assert carrier(fab, h, 0) == (1, "up"), f"host {h}"
    assert not probe(fab, 0, fab.nic_ip(1, 1), timeout=0.5)
    assert probe(fab, 0, fab.nic_ip(1, 0))
    assert probe(fab, 0, fab.mgmt_ip(1))  # mgmt is never faulted
    fab.rail_up(1)
    assert carrier(fab, 0, 1) == (1, "up")
    assert carrier(fab, 1, 1) == (1, "up")
    assert carrier(fab, 2, 1) == (0, "down")  # its own nic_down still holds
    assert probe(fab, 0, fab.nic_ip(1, 1))
    assert fab.faults()["nic_down"] == [(2, 1)]
    fab.heal()
    assert carrier(fab, 2, 1) == (1, "up")
    assert fab.faults() == {"nic_down": [], "rail_down": [], "blackhole": [], "slow": [],
                            "lossy": [], "flapping": []}


@pytest.mark.needs_nft
def test_blackhole_drops_while_link_stays_up(make_fabric, server):
    fab = make_fabric("b")
    server(fab, 1)
    assert probe(fab, 0, fab.nic_ip(1, 0))
    fab.blackhole(1, 0)
    assert carrier(fab, 1, 0) == (1, "up")  # link stays up
    cp = fab.run(0, [sys.executable, "-c", PROBE, fab.nic_ip(1, 0), str(PORT), "0.7"])
    assert cp.returncode == 1 and "timed out" in cp.stdout  # silent: only a timeout
    assert probe(fab, 0, fab.nic_ip(1, 1))
    assert fab.blackholes_in_kernel(1) == [0]
    fab.blackhole(1, 0, on=True)  # idempotent
    fab.blackhole(1, 0, on=False)
    assert fab.blackholes_in_kernel(1) == []
    assert probe(fab, 0, fab.nic_ip(1, 0))
    fab.blackhole(0, 1)
    assert not probe(fab, 0, fab.nic_ip(1, 1), timeout=0.5)
    fab.heal()
    assert fab.blackholes_in_kernel(0) == []
    assert probe(fab, 0, fab.nic_ip(1, 1))


def test_flap_ends_up(make_fabric, server):
    fab = make_fabric("f")
    server(fab, 1)
    mon = _start(fab, 0, LINKMON, "eth0", 5)
    h = fab.flap(0, 0, period_s=0.1, count=5)
    assert h.join(timeout=5)
    assert h.error is None and h.flaps_done == 5
    assert carrier(fab, 0, 0) == (1, "up")
    out, _ = mon.communicate(timeout=10)
    assert "lower_up=0" in out  # it did go down
    assert probe(fab, 0, fab.nic_ip(1, 0))
    # a long flap can be stopped; it leaves the link up
    h = fab.flap(0, 1, period_s=0.2, count=1000)
    with pytest.raises(FabricError, match="already flapping"):
        fab.flap(0, 1)
    time.sleep(0.15)
    assert h.stop(timeout=5)
    fab._wait_links({(0, 1): True})
    assert carrier(fab, 0, 1) == (1, "up")


def test_rate_limit_200mbit(make_fabric):
    fab = make_fabric("t", hosts=2, rails=1, rate_mbit=200)
    rx = _start(fab, 1, RECEIVER, PORT + 1, 0.3)
    fab.run(0, [sys.executable, "-c", SENDER, fab.nic_ip(1, 0), str(PORT + 1), "1.8"], timeout=20,
            check=True)
    out, err = rx.communicate(timeout=15)
    rate = float(out)
    assert 25e6 * 0.85 <= rate <= 25e6 * 1.15, f"{rate / 1e6:.1f} MB/s, want 25 +- 15%"


def _throughput(fab, src, dst, rail, port, seconds=1.8):
    """Steady-state bytes/s of one TCP stream from host src to host dst over rail."""
    rx = _start(fab, dst, RECEIVER, port, 0.3)
    fab.run(src, [sys.executable, "-c", SENDER, fab.nic_ip(dst, rail), str(port),
                  str(seconds)], timeout=20, check=True)
    out, err = rx.communicate(timeout=15)
    return float(out)


def test_slow_nic_cuts_rate_both_ways_and_heals(make_fabric):
    fab = make_fabric("s", hosts=2, rails=2, rate_mbit=200)
    fab.slow(0, 1, 10)
    assert fab.faults()["slow"] == [(0, 1, 10.0)]
    assert fab.nic_rate_mbit(0, 1) == pytest.approx(20, rel=0.01)
    assert fab.nic_rate_mbit(0, 0) == pytest.approx(200, rel=0.01)
    out_rate = _throughput(fab, 0, 1, 1, PORT + 2)  # host 0's egress tbf
    in_rate = _throughput(fab, 1, 0, 1, PORT + 3)   # the bridge port's tbf: host 0's ingress
    for rate in (out_rate, in_rate):
        assert 2.5e6 * 0.75 <= rate <= 2.5e6 * 1.25, f"{rate / 1e6:.2f} MB/s, want 2.5 +- 25%"
    # the link stays up and the other NIC keeps its full rate
    assert carrier(fab, 0, 1) == (1, "up")
    other = _throughput(fab, 0, 1, 0, PORT + 4, seconds=1.2)
    assert other >= 25e6 * 0.85, f"untouched NIC at {other / 1e6:.1f} MB/s"
    fab.slow(0, 1, on=False)
    assert fab.faults()["slow"] == []
    healed = _throughput(fab, 0, 1, 1, PORT + 5, seconds=1.2)
    assert 25e6 * 0.85 <= healed <= 25e6 * 1.15, f"healed at {healed / 1e6:.1f} MB/s"
    fab.slow(1, 0, 50)
    fab.heal()
    assert fab.nic_rate_mbit(1, 0) == pytest.approx(200, rel=0.01)
    assert fab.faults()["slow"] == []


# UDP counter: receive datagrams for argv[2] seconds after "ready", print the count
UDP_COUNT = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
# Room for every datagram (~1 KiB of buffer each): a receiver descheduled for a
# while on a loaded box must not drop what the fault did not (root may force it).
try:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUFFORCE, 16 << 20)
except (OSError, AttributeError):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(0.2)
print("ready", flush=True)
seen = set()
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        msg = s.recv(64)
        if not msg.startswith(b"w"):
            seen.add(msg)
    except socket.timeout:
        pass
print(len(seen))
"""

UDP_SEND = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(20):  # resolve ARP first: datagrams sent before it resolves are dropped
    s.sendto(b"w", (sys.argv[1], int(sys.argv[2])))
    time.sleep(0.01)
for i in range(int(sys.argv[3])):
    s.sendto(str(i).encode(), (sys.argv[1], int(sys.argv[2])))
    if i % 50 == 49:
        time.sleep(0.002)  # stay far below any queue limit: only the fault drops
"""


def _udp_delivered(fab, src, dst, rail, port, count=4000):
    rx = _start(fab, dst, UDP_COUNT, port, 3.0)
    fab.run(src, [sys.executable, "-c", UDP_SEND, fab.nic_ip(dst, rail), str(port),
                  str(count)], timeout=20, check=True)
    out, _ = rx.communicate(timeout=15)
    return int(out) / count


@pytest.mark.needs_nft
def test_lossy_nic_drops_a_share_and_heals(make_fabric, server):
    fab = make_fabric("l")
    server(fab, 1)
    assert _udp_delivered(fab, 0, 1, 0, PORT + 6) == 1.0  # no loss before
    fab.lossy(1, 0, 20)
    assert fab.faults()["lossy"] == [(1, 0, 20.0)]
    assert carrier(fab, 1, 0) == (1, "up")
    # 4000 draws at p = 0.8: sd 0.6%, so 0.75..0.85 fails only on a real error
    into = _udp_delivered(fab, 0, 1, 0, PORT + 7)
    assert 0.75 <= into <= 0.85, f"{into:.3f} delivered into the lossy NIC, want ~0.80"
    out_of = _udp_delivered(fab, 1, 0, 0, PORT + 8)
    assert 0.75 <= out_of <= 0.85, f"{out_of:.3f} delivered out of the lossy NIC, want ~0.80"
    assert _udp_delivered(fab, 0, 1, 1, PORT + 9) == 1.0  # the other NIC is clean
    fab.lossy(1, 0, on=False)
    assert fab.faults()["lossy"] == []
    assert _udp_delivered(fab, 0, 1, 0, PORT + 10) == 1.0
    fab.lossy(0, 1, 50)
    fab.heal()
    assert fab.faults()["lossy"] == []
    assert _udp_delivered(fab, 0, 1, 1, PORT + 11) == 1.0


def test_slow_and_lossy_reject_bad_input(make_fabric):
    fab = make_fabric("v", hosts=2, rails=1)  # no rate cap
    with pytest.raises(FabricError, match="needs a rate-capped fabric"):
        fab.slow(0, 0, 10)
    for bad in (0, 100, -5, 150, "10%", None, True):
        with pytest.raises(ValueError, match=r"percent .* in \(0, 100\)"):
            fab.lossy(0, 0, bad)
    with pytest.raises(ValueError, match="resolution"):
        fab.lossy(0, 0, 0.001)
    with pytest.raises(ValueError, match="rail must be an int in 0..0"):
        fab.lossy(0, 1, 5)
    capped = Fabric(hosts=1, rails=1, rate_mbit=100, name="zz")  # validation only, not built
    with pytest.raises(ValueError, match=r"slow: percent of the fabric rate must be"):
        capped.slow(0, 0, 0)
    assert fab.faults()["lossy"] == [] and fab.faults()["slow"] == []


# --------------------------------------------------------------- lifecycle
def test_teardown_leaves_nothing_and_down_twice(root):
    fab = Fabric(hosts=2, rails=2, name=_unique_name("d"))
    fab.up()
    assert len(_leftovers(fab.name)[0]) == 2
    assert len(_leftovers(fab.name)[1]) == 2 * 3 + 3  # 6 veth ends + 3 bridges
    srv = _start(fab, 1, SERVER, PORT)  # a process still inside at teardown
    fab.down()
    assert _leftovers(fab.name) == ([], [])
    assert not os.path.exists(fabric_mod._state_path(fab.name))
    assert srv.wait(5) is not None  # it was ended with its namespace
    fab.down()
    Fabric.cleanup(fab.name)
    with pytest.raises(FabricError, match="no fabric named"):
        Fabric.attach(fab.name)


def test_exception_inside_with_tears_down(root):
    name = _unique_name("e")
    with pytest.raises(KeyError):
        with Fabric(hosts=2, rails=1, name=name) as fab:
            assert len(_leftovers(name)[0]) == 2
            fab.nic_down(0, 0)
            raise KeyError("boom")
    assert _leftovers(name) == ([], [])


def test_failed_build_cleans_up(root, monkeypatch):
    name = _unique_name("x")
    calls = []

    def bad_tbf(self, ipr, idx):
        calls.append(idx)
        if len(calls) == 3:
            raise OSError("injected tbf failure")

    monkeypatch.setattr(Fabric, "_tbf", bad_tbf)
    with pytest.raises(FabricError, match=r"tbf on .* failed: injected tbf failure"):
        Fabric(hosts=2, rails=2, rate_mbit=100, name=name).up()
    assert _leftovers(name) == ([], [])
    assert not os.path.exists(fabric_mod._state_path(name))


def test_two_fabrics_coexist(make_fabric, server):
    a = make_fabric("p", hosts=2, rails=1)
    b = make_fabric("q", hosts=2, rails=1)
    with pytest.raises(FabricError, match="already exists"):
        Fabric(hosts=2, rails=1, name=a.name).up()
    server(a, 1)
    server(b, 1)  # same addresses, other namespaces
    a.nic_down(1, 0)
    assert not probe(a, 0, a.nic_ip(1, 0), timeout=0.5)
    assert probe(b, 0, b.nic_ip(1, 0))
    a.down()
    assert _leftovers(a.name) == ([], [])
    assert len(_leftovers(b.name)[0]) == 2
    assert probe(b, 0, b.nic_ip(1, 0))


def _congestion(fab, host):
    return fab.run(host, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], timeout=10).stdout.strip()


def test_hosts_use_the_chosen_tcp_congestion_control_not_this_machines(root):
    """cubic unless told otherwise, whatever the root namespace uses; None keeps
    what a new namespace gets; a name the kernel lacks fails before anything is built."""
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        available = f.read().split()
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        machine = f.read().strip()
    other = next(a for a in available if a != "cubic")  # reno is always built in
    with Fabric(hosts=2, rails=1, name=_unique_name("dc")) as fab:
        assert [_congestion(fab, h) for h in range(2)] == ["cubic", "cubic"]
        assert Fabric.attach(fab.name).tcp_congestion == "cubic"
    with Fabric(hosts=1, rails=1, name=_unique_name("dc"), tcp_congestion=other) as fab:
        assert _congestion(fab, 0) == other
    with Fabric(hosts=1, rails=1, name=_unique_name("dc"), tcp_congestion=None) as fab:
        assert _congestion(fab, 0) == machine
    name = _unique_name("dc")
    with pytest.raises(FabricError, match="'nosuchcc' is not available in this kernel; available: "
                                          + ", ".join(available)):
        Fabric(hosts=1, rails=1, name=name, tcp_congestion="nosuchcc").up()
    assert _leftovers(name) == ([], [])


ALLOWED_PATH = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"

# builds a fabric that needs argv[2], says so, and waits to be killed
BUILD_AND_WAIT = r"""
import sys, time, warnings
from torch_reccl.fabric import Fabric
warnings.simplefilter("ignore")
Fabric(hosts=1, rails=1, name=sys.argv[1], tcp_congestion=sys.argv[2]).up()
print("up", flush=True)
time.sleep(60)
"""


def _allowed() -> str:
    with open(ALLOWED_PATH) as f:
        return f.read().strip()


@pytest.fixture
def disallowed_congestion(root):
    """An available algorithm that neither is the machine's default nor on the
    allowed list (taken off it here); the list as it was comes back afterwards."""
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        available = f.read().split()
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        machine = f.read().strip()
    target = next((a for a in available if a not in (machine, "reno")), None)
    if target is None:
        pytest.skip(f"this kernel offers no TCP congestion control but {machine} and reno")
    saved = _allowed()
    with open(ALLOWED_PATH, "w") as f:
        f.write(" ".join(a for a in saved.split() if a != target))
    try:
        yield target, _allowed()
    finally:
        with open(ALLOWED_PATH, "w") as f:
            f.write(saved)


def test_an_algorithm_namespaces_may_not_use_yet_is_allowed_while_needed(disallowed_congestion):
    """A namespace may default only to an algorithm on the machine-wide allowed
    list (a fresh machine allows its default and reno): the fabric adds the one
    it needs, says so, keeps it while any fabric that needs it is up, and puts
    the list back when the last one goes."""
    target, before = disallowed_congestion
    first = Fabric(hosts=1, rails=1, name=_unique_name("dc"), tcp_congestion=target)
    second = Fabric(hosts=1, rails=1, name=_unique_name("dc"), tcp_congestion=target)
    try:
        with pytest.warns(UserWarning, match=f"added {target} to net.ipv4.tcp_allowed_congestion_control"):
            first.up()
        assert _congestion(first, 0) == target and target in _allowed().split()
        second.up()
        first.down()
        assert target in _allowed().split()  # the second fabric still needs it
        assert _congestion(second, 0) == target
    finally:
        first.down()
        second.down()
    assert _allowed() == before
    assert not os.path.exists(fabric_mod.ALLOWED_RECORD)


def test_the_allowed_list_comes_back_after_kill_9_through_fabric_down(disallowed_congestion):
    """The builder killed with SIGKILL cannot restore anything; `reccl fabric
    down` (Fabric.cleanup) does, from the record under /run."""
    target, before = disallowed_congestion
    name = _unique_name("dc")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-c", BUILD_AND_WAIT, name, target], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up", proc.stderr.read()
        proc.kill()
        proc.wait(10)
        assert target in _allowed().split()
        with open(fabric_mod.ALLOWED_RECORD) as f:
            assert json.load(f)[target] == {"before": before, "fabrics": [name]}
        cp = _cli("down", "--name", name)
        assert cp.returncode == 0, cp.stderr
        assert _allowed() == before
        assert _leftovers(name) == ([], [])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        Fabric.cleanup(name)


def test_attach_shares_state(make_fabric):
    fab = make_fabric("a")
    other = Fabric.attach(fab.name)
    assert (other.hosts, other.rails, other.rate_mbit) == (2, 2, None)
    other.nic_down(0, 1)
    assert fab.faults()["nic_down"] == [(0, 1)]
    fab.nic_up(0, 1)  # the attached object sees the change too
    assert other.faults()["nic_down"] == []
    assert carrier(fab, 0, 1) == (1, "up")
    assert Fabric.builder_pid(fab.name) == os.getpid()
    assert Fabric.builder_pid(_unique_name("n")) is None  # no such fabric


def test_stale_fabric_of_a_dead_run_is_reclaimed(make_fabric):
    """A test-owned fabric name left by a run that died is taken down before
    the module builds it again; one whose builder is alive is left alone."""
    from training_fabric import reclaim_stale
    fab = make_fabric("st")
    reclaim_stale(fab.name)  # built by this live process: untouched
    assert carrier(fab, 0, 0) == (1, "up")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    path = os.path.join(fabric_mod.STATE_DIR, f"{fab.name}.json")
    with open(path) as f:
        state = json.load(f)
    state["pid"] = int(dead.stdout)
    with open(path, "w") as f:
        json.dump(state, f)
    reclaim_stale(fab.name)
    assert fab.name not in fabric_mod.list_fabrics()
    assert _leftovers(fab.name) == ([], [])
    Fabric(hosts=2, rails=2, name=fab.name).up().down()  # the name is free again


# --------------------------------------------------------------- CLI
def _cli(*args, timeout=30, entry=("torch_reccl.fabric.cli", "fabric")):
    """Run the fabric CLI in a subprocess. By default through the fabric
    module's own main (the same parser `reccl fabric` mounts), so the round trip
    does not depend on the other subcommands; test_reccl_entry_point covers
    `python -m torch_reccl fabric`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", *entry, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_reccl_entry_point(root):
    """`python -m torch_reccl fabric ...` reaches the fabric CLI."""
    try:
        from torch_reccl.cli import build_parser

        build_parser()
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("torch_reccl.") and "fabric" not in e.name:
            pytest.skip(f"`reccl` cannot load another subcommand yet: {e}")
        raise
    name = _unique_name("m")
    try:
        cp = _cli("up", "--name", name, "--hosts", "2", "--rails", "1",
                  entry=("torch_reccl", "fabric"))
        assert cp.returncode == 0, cp.stderr
        cp = _cli("list", entry=("torch_reccl", "fabric"))
        assert cp.returncode == 0 and name in cp.stdout.split(), (cp.stdout, cp.stderr)
        cp = _cli("down", "--name", name, entry=("torch_reccl", "fabric"))
        assert cp.returncode == 0, cp.stderr
        assert _leftovers(name) == ([], [])
    finally:
        Fabric.cleanup(name)


@pytest.mark.needs_nft
def test_cli_round_trip(root):
    name = _unique_name("k")
    try:
        cp = _cli("up", "--name", name, "--hosts", "2", "--rails", "2", "--rate-mbit", "500",
                  "--tcp-congestion", "Bad!")
        assert cp.returncode == 2 and "--tcp-congestion 'Bad!': want an algorithm's name" in cp.stderr
        cp = _cli("up", "--name", name, "--hosts", "2", "--rails", "2", "--rate-mbit", "500",
                  "--tcp-congestion", "reno")
        assert cp.returncode == 0, cp.stderr
        assert f"fabric {name}: 2 hosts x 2 rails, 500 mbit/s per NIC, TCP congestion control reno" \
            in cp.stdout
        cp = _cli("fail", "--name", name, "nic", "1:0")
        assert cp.returncode == 0, cp.stderr
        cp = _cli("fail", "--name", name, "rail", "7")
        assert cp.returncode == 2 and "rail must be an int in 0..1" in cp.stderr
        cp = _cli("exec", "--name", name, "1", "--", "cat", "/sys/class/net/eth0/carrier",
                  "/sys/class/net/eth1/carrier")
        assert cp.returncode == 0 and cp.stdout.split() == ["0", "1"], (cp.stdout, cp.stderr)
        cp = _cli("exec", "--name", name, "0", "--", "sh", "-c", "exit 3")
        assert cp.returncode == 3
        cp = _cli("show", "--name", name, "--json")
        info = json.loads(cp.stdout)
        assert info["faults"]["nic_down"] == [[1, 0]]
        assert info["host_state"][1]["nics"][0]["carrier"] is False
        cp = _cli("fail", "--name", name, "flap", "0:1", "--period", "0.05", "--count", "3")
        assert cp.returncode == 0 and "flapped 3 times" in cp.stdout, cp.stderr
        cp = _cli("heal", "--name", name, "nic", "1:0")
        assert cp.returncode == 0, cp.stderr
        cp = _cli("fail", "--name", name, "rail", "1")
        assert cp.returncode == 0, cp.stderr
        fab = Fabric.attach(name)
        assert carrier(fab, 0, 1) == (0, "down") and carrier(fab, 1, 0) == (1, "up")
        cp = _cli("fail", "--name", name, "slow", "1:0", "--percent", "20")
        assert cp.returncode == 0 and "slowed to 20%" in cp.stdout, cp.stderr
        assert fab.nic_rate_mbit(1, 0) == pytest.approx(100, rel=0.01)
        cp = _cli("fail", "--name", name, "lossy", "0:0")  # default 5%
        assert cp.returncode == 0 and "drops 5% of its frames" in cp.stdout, cp.stderr
        cp = _cli("show", "--name", name)
        assert "SLOW 20%" in cp.stdout and "LOSSY 5%" in cp.stdout, cp.stdout
        cp = _cli("fail", "--name", name, "lossy", "0:0", "--percent", "120")
        assert cp.returncode == 2 and "in (0, 100)" in cp.stderr, cp.stderr
        cp = _cli("heal", "--name", name, "slow", "1:0")
        assert cp.returncode == 0, cp.stderr
        assert fab.nic_rate_mbit(1, 0) == pytest.approx(500, rel=0.01)
        assert fab.faults()["lossy"] == [(0, 0, 5.0)]
        cp = _cli("heal", "--name", name)
        assert cp.returncode == 0, cp.stderr
        assert carrier(fab, 0, 1) == (1, "up")
        assert fab.faults()["lossy"] == []
        cp = _cli("down", "--name", name)
        assert cp.returncode == 0, cp.stderr
        assert _leftovers(name) == ([], [])
        cp = _cli("show", "--name", name)
        assert cp.returncode == 1 and "no fabric named" in cp.stderr
    finally:
        Fabric.cleanup(name)
