"""Same-host reads (transport/same_host.h, docs/transport.md "Same-host reads").

Between two processes of one kernel, network and pid namespace, a TCP path's
receiver copies payloads of 16 KiB or more straight out of the sender's memory
instead of both ends copying them through loopback TCP. Tested here: each
half on its own (a sender's token window, a receiver's read, the revocation
that keeps a receiver from landing bytes of a buffer its sender gave up), the
host key that keeps namespaces apart, and collectives of real ranks bit for bit
against the same job with the reads off. The transport contract suite runs its
fault tests over both TCP modes (test_transport_contract.py, "tcp" and
"tcp-sockets").
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import report_rank, run_rank_job, testing as load_testing

pytestmark = pytest.mark.timeout(120)

NICS = "127.0.0.1,127.0.0.2"
WORLD = 3
JOB_TIMEOUT_S = 90


# A sender stand-in: a process holding a window and a buffer, revoking on request.
SENDER = textwrap.dedent("""
    import ctypes, sys
    import torch
    import torch_reccl._testing as t
    window = t.SameHostWindow()
    data = bytes(range(256)) * 4096  # 1 MiB
    buffer = ctypes.create_string_buffer(data, len(data))
    print(window.token_address, window.token, ctypes.addressof(buffer), len(data), flush=True)
    for line in sys.stdin:
        if line.strip() == "revoke":
            window.revoke()
            print("revoked", flush=True)
        elif line.strip() == "exit":
            break
""")


@pytest.fixture
def sender():
    proc = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        token_address, token, address, size = map(int, proc.stdout.readline().split())
        yield proc, token_address, token, address, size
    finally:
        if proc.poll() is None:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_a_read_copies_the_senders_bytes_until_it_revokes_its_window(sender):
    t = load_testing()
    proc, token_address, token, address, size = sender
    ok, got = t.same_host_read(proc.pid, token_address, token, address, size)
    assert ok, got
    assert got == bytes(range(256)) * 4096
    ok, got = t.same_host_read(proc.pid, token_address, token, address + 1000, 24)
    assert ok and got == (bytes(range(256)) * 2)[1000 % 256:1000 % 256 + 24]
    # A token that is not the one offered: the pid or address named another word.
    ok, why = t.same_host_read(proc.pid, token_address, token ^ 1, address, 16)
    assert not ok and b"revoked" in why, why
    # Memory the sender does not have mapped: refused, not a crash or garbage.
    ok, why = t.same_host_read(proc.pid, token_address, token, 8, 16)
    assert not ok and b"Bad address" in why, why
    proc.stdin.write("revoke\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "revoked"
    ok, why = t.same_host_read(proc.pid, token_address, token, address, size)
    assert not ok and b"revoked its same-host window" in why, why


def test_a_window_is_checked_in_the_process_named_not_in_the_reader(sender):
    """The token lives at its address only in the sender: the same address read
    in another process (here the reader itself) does not hold it."""
    t = load_testing()
    _proc, token_address, token, address, _size = sender
    ok, why = t.same_host_read(os.getpid(), token_address, token, address, 16)
    assert not ok, why
    local = t.SameHostWindow()
    buffer = ctypes.create_string_buffer(b"x" * 64, 64)
    ok, got = t.same_host_read(os.getpid(), local.token_address, local.token,
                               ctypes.addressof(buffer), 64)
    assert ok and got == b"x" * 64


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace (unshare -n)")
def test_another_network_namespace_is_another_host():
    """The emulated fabric's hosts are network namespaces of one kernel: their
    paths must cross the emulated NICs, so their keys differ and no offer is taken."""
    t = load_testing()
    code = "import torch, torch_reccl._testing as t; print(t.same_host_key())"
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    there = subprocess.run(["unshare", "-n", sys.executable, "-c", code], capture_output=True,
                           text=True, timeout=60)
    assert here.returncode == 0 and there.returncode == 0, (here.stderr, there.stderr)
    assert int(here.stdout) == t.same_host_key() != 0
    assert int(there.stdout) != t.same_host_key()


# --------------------------------------------------------------------------- real ranks


def rank_main(rank, port, out_dir, same_host_reads):
    os.environ.update({"RECCL_NICS": NICS, "RECCL_SAME_HOST_READS": same_host_reads,
                       "RECCL_HEARTBEAT_MS": "1000"})

    def body(result):
        import datetime

        import torch
        import torch.distributed as dist

        import torch_reccl

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, WORLD, False,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("reccl", store=store, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        digests = {}

        def digest(name, tensor):
            digests[name] = hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()

        n = (3 << 20) + 12345  # 12 MiB of float32: many 1 MiB chunks, an odd tail
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(n, generator=g)
        y = x.clone()
        dist.all_reduce(y)
        digest("all_reduce_f32", y)
        ints = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64)
        z = ints.clone()
        dist.all_reduce(z)
        digest("all_reduce_i64", z)
        result["i64_exact"] = bool(torch.equal(z, reference_int_sum(torch, n)))
        gathered = [torch.empty(n) for _ in range(WORLD)]
        dist.all_gather(gathered, x)
        digest("all_gather", torch.cat(gathered))
        result["gather_exact"] = all(torch.equal(gathered[r], rank_input(torch, r, n))
                                     for r in range(WORLD))
        b = x.clone() if rank == 1 else torch.empty(n)
        dist.broadcast(b, src=1)
        digest("broadcast", b)
        out = torch.empty(n // WORLD)
        dist.reduce_scatter(out, list(x[: (n // WORLD) * WORLD].chunk(WORLD)))
        digest("reduce_scatter", out)
        result["digests"] = digests
        result["same_host_bytes"] = sum(nic["same_host_bytes"]
                                        for nic in torch_reccl.stats()["nics"].values())
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


def rank_input(torch, rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))


def reference_int_sum(torch, n):
    total = torch.zeros(n, dtype=torch.int64)
    for r in range(WORLD):
        g = torch.Generator().manual_seed(100 + r)
        torch.randn(n, generator=g)  # the float input drawn first, as in the rank
        total += torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64)
    return total


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_collectives_are_bit_identical_with_and_without_same_host_reads(tmp_path):
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    on = run_rank_job(tmp_path / "on", rank_main, WORLD, ("1",), JOB_TIMEOUT_S)
    off = run_rank_job(tmp_path / "off", rank_main, WORLD, ("0",), JOB_TIMEOUT_S)
    for r in range(WORLD):
        assert on[r]["i64_exact"] and off[r]["i64_exact"], r
        assert on[r]["gather_exact"] and off[r]["gather_exact"], r
        assert on[r]["digests"] == off[r]["digests"], r
        assert on[r]["same_host_bytes"] > (24 << 20), on[r]["same_host_bytes"]
        assert off[r]["same_host_bytes"] == 0, off[r]["same_host_bytes"]
    # Every rank computed the same all_reduce and all_gather.
    for name in ("all_reduce_f32", "all_reduce_i64", "all_gather", "broadcast"):
        assert len({on[r]["digests"][name] for r in range(WORLD)}) == 1, name
