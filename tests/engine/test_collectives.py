"""End-to-end tests of the "reccl" torch.distributed backend (CPU tensors).

Each session spawns real processes (2 ranks over a FileStore with explicit
init, 4 ranks over a TCPStore through torchrun's env:// variables), all on two
loopback "NICs" (RECCL_NICS=127.0.0.1,127.0.0.2). Every rank runs the same list
of scenarios in order and records, per scenario, "ok" or the error; the test
functions below assert on those records, one per scenario. References are
computed locally from the deterministic inputs of every rank. Spawning costs
seconds per session (importing torch), so each session covers many scenarios.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import time
import traceback
from typing import Callable, Dict, List

import pytest

from collective_checks import check_equal, dtype_of, make_input, ops_for, reference, split_sizes

NICS = "127.0.0.1,127.0.0.2"
GROUP_TIMEOUT_S = 30          # the world group's timeout (every op is bounded by it)
SHORT_TIMEOUT_S = 3           # groups that test timeouts and mismatches
SESSION_TIMEOUT_S = 150       # bound on one spawned session

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "bool"]
SMALL, LARGE = 7, 70001       # LARGE crosses the 16 KiB inline threshold for every dtype


# --------------------------------------------------------------------------- helpers (in ranks)


def native_threads():
    """Threads of this process, not counting the TCPStore's own (torch keeps a store
    alive as long as anything references its process group, e.g. DDP leftovers)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        count += not name.startswith("pt_tcpstore")
    return count


def socket_table(store_port=None):
    """This process's open sockets as "local -> remote state" (TCP) or "socket:[inode]",
    not counting those of the TCPStore at `store_port`."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    described = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            local, remote = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
            if store_port is not None and store_port in (local, remote):
                inodes.discard(fields[9])
            else:
                described[fields[9]] = f"tcp :{local} -> :{remote} state {fields[3]}"
    return sorted(described.get(i, f"socket:[{i}]") for i in inodes)


def open_sockets(store_port=None):
    return len(socket_table(store_port))


def expect_error(fn, *needles, within=None):
    """Runs fn; it must raise an error whose message contains every needle."""
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - any error type, the message is what counts
        message = str(error)
        missing = [n for n in needles if n not in message]
        if missing:
            raise AssertionError(f"error lacks {missing}: {message}") from error
        if within is not None and time.monotonic() - start > within:
            raise AssertionError(f"error came after {time.monotonic() - start:.1f} s (> {within} s)")
        return message
    raise AssertionError(f"no error raised; expected one naming {needles}")


# --------------------------------------------------------------------------- scenarios


def sc_allreduce_all_ops_dtypes(rank, size, ctx):
    dist = ctx["dist"]
    for dtype_name in DTYPES:
        for op in ops_for(dtype_name):
            for n in (SMALL, LARGE):
                t = make_input(rank, n, dtype_name, op)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                expected = reference([make_input(r, n, dtype_name, op) for r in range(size)], op, dtype_name)
                check_equal(t, expected, f"all_reduce {dtype_name} {op} n={n}")


def sc_half_precision_bits(rank, size, ctx):
    """Two ranks: every float16/bfloat16/float32 result is the correctly rounded sum/product
    (bit for bit: subnormals, overflow to inf, ties) or min/max of the two inputs, on the
    small-message and the ring path."""
    torch, dist = ctx["torch"], ctx["dist"]
    assert size == 2
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for n in (SMALL * 100, LARGE):
            inputs = []
            for r in range(size):
                g = torch.Generator().manual_seed(7 + r)
                scale = torch.pow(2.0, torch.randint(-30, 17, (n,), generator=g).float())
                inputs.append((torch.randn(n, generator=g) * scale).to(dtype))
            for op in ("SUM", "PRODUCT", "MIN", "MAX"):
                t = inputs[rank].clone()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                a, b = inputs[0].float(), inputs[1].float()
                expected = {"SUM": a + b, "PRODUCT": a * b, "MIN": torch.minimum(a, b),
                            "MAX": torch.maximum(a, b)}[op].to(dtype)
                # bit for bit, except that MIN/MAX order -0 below +0 (torch's pick varies)
                same = torch.equal(t, expected) if op in ("MIN", "MAX") else torch.equal(
                    t.view(torch.int16 if dtype != torch.float32 else torch.int32),
                    expected.view(torch.int16 if dtype != torch.float32 else torch.int32))
                if not same:
                    bits = torch.int16 if dtype != torch.float32 else torch.int32
                    bad = (t.view(bits) != expected.view(bits)).nonzero()[0].item()
                    raise AssertionError(f"{dtype} {op} n={n}: element {bad}: {t[bad].item()} != "
                                         f"{expected[bad].item()} (inputs {a[bad].item()}, {b[bad].item()})")


def sc_allreduce_async_future(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    tensors = [torch.full((n,), float(rank + 1)) for n in (3, 50000, 0)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works]
    total = float(sum(range(1, size + 1)))
    for fut, t in zip(futures, tensors):
        doubled = fut.wait()
        check_equal(t, torch.full_like(t, total), "async all_reduce")
        check_equal(doubled, torch.full_like(t, 2 * total), "future.then")


def sc_broadcast(rank, size, ctx):
    dist = ctx["dist"]
    for dtype_name in DTYPES:
        for n in (SMALL, LARGE):
            for root in range(size):
                t = make_input(rank, n, dtype_name, salt=root + 1)
                dist.broadcast(t, src=root)
                check_equal(t, make_input(root, n, dtype_name, salt=root + 1), f"broadcast {dtype_name} root {root}")


def sc_reduce(rank, size, ctx):
    dist = ctx["dist"]
    root = size - 1
    for dtype_name in ("float32", "bfloat16", "int32", "uint8", "bool"):
        for op in ops_for(dtype_name):
            for n in (SMALL, LARGE):
                t = make_input(rank, n, dtype_name, op)
                before = t.clone()
                dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op))
                if rank == root:
                    expected = reference([make_input(r, n, dtype_name, op) for r in range(size)], op, dtype_name)
                    check_equal(t, expected, f"reduce {dtype_name} {op} n={n}")
                else:
                    check_equal(t, before, "reduce leaves non-root tensors alone")


def sc_allgather(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    for dtype_name in DTYPES:
        for n in (SMALL, LARGE):
            mine = make_input(rank, n, dtype_name)
            every = [make_input(r, n, dtype_name) for r in range(size)]
            outs = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(outs, mine)
            for r in range(size):
                check_equal(outs[r], every[r], f"all_gather {dtype_name} n={n} from {r}")
            flat = torch.empty(size * n, dtype=mine.dtype)
            dist.all_gather_into_tensor(flat, mine)
            check_equal(flat, torch.cat(every), f"all_gather_into_tensor {dtype_name} n={n}")


def sc_reduce_scatter(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    for dtype_name in ("float16", "float32", "float64", "int8", "int64", "bool"):
        for op in ops_for(dtype_name):
            for n in (SMALL, LARGE):
                inputs = [make_input(r, size * n, dtype_name, op) for r in range(size)]
                expected = reference(inputs, op, dtype_name)[rank * n:(rank + 1) * n]
                out = torch.empty(n, dtype=dtype_of(dtype_name))
                dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=getattr(dist.ReduceOp, op))
                check_equal(out, expected, f"reduce_scatter_tensor {dtype_name} {op} n={n}")
                out2 = torch.empty(n, dtype=dtype_of(dtype_name))
                dist.reduce_scatter(out2, list(inputs[rank].chunk(size)), op=getattr(dist.ReduceOp, op))
                check_equal(out2, expected, f"reduce_scatter {dtype_name} {op} n={n}")


def sc_gather_scatter(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    for n in (SMALL, LARGE):
        for root in range(size):
            mine = make_input(rank, n, "float32", salt=root)
            outs = [torch.empty_like(mine) for _ in range(size)] if rank == root else None
            dist.gather(mine, outs, dst=root)
            if rank == root:
                for r in range(size):
                    check_equal(outs[r], make_input(r, n, "float32", salt=root), f"gather n={n} root {root}")
            pieces = [make_input(r, n, "int16", salt=root) for r in range(size)]
            out = torch.empty(n, dtype=torch.int16)
            dist.scatter(out, pieces if rank == root else None, src=root)
            check_equal(out, make_input(rank, n, "int16", salt=root), f"scatter n={n} root {root}")


def sc_alltoall(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    for scale in (1, 5000):  # inline and large transfers
        for dtype_name in ("float32", "bfloat16", "int64", "bool"):
            in_splits = [split_sizes(rank, r, scale) for r in range(size)]
            out_splits = [split_sizes(r, rank, scale) for r in range(size)]
            rows = [make_input(rank, in_splits[r] * 3, dtype_name, salt=r).reshape(-1, 3) for r in range(size)]
            inp = torch.cat(rows)
            out = torch.empty(sum(out_splits), 3, dtype=inp.dtype)
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            expected = torch.cat([make_input(r, out_splits[r] * 3, dtype_name, salt=rank).reshape(-1, 3)
                                  for r in range(size)])
            check_equal(out, expected, f"all_to_all_single uneven {dtype_name} scale {scale}")
        even_in = make_input(rank, size * 4 * scale, "int32")
        even_out = torch.empty_like(even_in)
        dist.all_to_all_single(even_out, even_in)
        expected = torch.cat([make_input(r, size * 4 * scale, "int32").chunk(size)[rank] for r in range(size)])
        check_equal(even_out, expected, "all_to_all_single even")
        ins = [make_input(rank, 2 * scale + r, "float64", salt=r) for r in range(size)]
        outs = [torch.empty(2 * scale + rank, dtype=torch.float64) for _ in range(size)]
        dist.all_to_all(outs, ins)
        for r in range(size):
            check_equal(outs[r], make_input(r, 2 * scale + rank, "float64", salt=rank), "all_to_all list")


def sc_send_recv(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for n in (SMALL, LARGE):
        for tag in (0, 7):
            send = make_input(rank, n, "float64", salt=tag)
            recv = torch.empty(n, dtype=torch.float64)
            reqs = [dist.isend(send, nxt, tag=tag), dist.irecv(recv, prv, tag=tag)]
            for req in reqs:
                req.wait()
            check_equal(recv, make_input(prv, n, "float64", salt=tag), f"isend/irecv n={n} tag {tag}")
    # batch_isend_irecv both ways with every peer
    ops, got = [], {}
    for peer in range(size):
        if peer == rank:
            continue
        got[peer] = torch.empty(100, dtype=torch.int32)
        ops.append(dist.P2POp(dist.isend, make_input(rank, 100, "int32", salt=peer), peer))
        ops.append(dist.P2POp(dist.irecv, got[peer], peer))
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for peer, t in got.items():
        check_equal(t, make_input(peer, 100, "int32", salt=rank), "batch_isend_irecv")


def sc_recv_any_source(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    if rank == 0:
        seen = set()
        for _ in range(size - 1):
            t = torch.empty(5, dtype=torch.int64)
            src = dist.recv(t)  # any source
            check_equal(t, torch.full((5,), src, dtype=torch.int64), "recv from any source")
            seen.add(src)
        assert seen == set(range(1, size)), f"sources {seen}"
    else:
        dist.send(torch.full((5,), rank, dtype=torch.int64), 0)
    dist.barrier()


def sc_noncontiguous(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    base = make_input(rank, 64 * 9, "float32").reshape(64, 9)
    view = base.t()[2:5]  # non-contiguous
    assert not view.is_contiguous()
    expected = reference([make_input(r, 64 * 9, "float32").reshape(64, 9).t()[2:5] for r in range(size)],
                         "SUM", "float32")
    dist.all_reduce(view)
    check_equal(view.contiguous(), expected, "all_reduce of a non-contiguous view")
    check_equal(base.t()[2:5].contiguous(), expected, "the view's storage was written")
    out = torch.empty(64, size * 3).t()  # non-contiguous output
    dist.all_gather_into_tensor(out, make_input(rank, 3 * 64, "int32").reshape(3, 64).float())
    expected = torch.cat([make_input(r, 3 * 64, "int32").reshape(3, 64).float() for r in range(size)])
    check_equal(out.contiguous(), expected, "all_gather_into_tensor into a non-contiguous output")
    recv = torch.empty(4, 10).t()
    if rank == 0:
        dist.send(torch.arange(40.0).reshape(4, 10).t(), 1)
    elif rank == 1:
        dist.recv(recv, 0)
        check_equal(recv, torch.arange(40.0).reshape(4, 10).t(), "recv into a non-contiguous tensor")
    dist.barrier()


def sc_coalesced(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    tensors = [make_input(rank, n, "float32") for n in (3, 40000, 11)]
    expected = [reference([make_input(r, t.numel(), "float32") for r in range(size)], "SUM", "float32")
                for t in tensors]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t)
    cm.wait()
    for t, e in zip(tensors, expected):
        check_equal(t, e, "coalesced all_reduce")
    ins = [make_input(rank, n, "int32") for n in (5, 9000)]
    outs = [torch.empty(size * t.numel(), dtype=torch.int32) for t in ins]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o, i in zip(outs, ins):
        check_equal(o, torch.cat([make_input(r, i.numel(), "int32") for r in range(size)]), "coalesced all_gather")
    rs_in = [make_input(rank, size * n, "float64") for n in (4, 5000)]
    rs_out = [torch.empty(t.numel() // size, dtype=torch.float64) for t in rs_in]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(rs_out, rs_in):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    for o, i in zip(rs_out, rs_in):
        n = o.numel()
        full = reference([make_input(r, size * n, "float64") for r in range(size)], "SUM", "float64")
        check_equal(o, full[rank * n:(rank + 1) * n], "coalesced reduce_scatter")


def sc_rejects_clearly(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    expect_error(lambda: dist.all_reduce(torch.zeros(3, dtype=torch.uint32)), "UInt32", "supported dtypes")
    expect_error(lambda: dist.all_reduce(torch.zeros(3), op=dist.ReduceOp.BAND), "BAND", "float32")
    expect_error(lambda: dist.all_reduce(torch.zeros(3, dtype=torch.bool), op=dist.ReduceOp.AVG), "AVG", "bool")
    dist.barrier()  # the group is still usable


def sc_mismatch(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    odd = rank == size - 1
    # kind: the last rank broadcasts while the others all-reduce
    t = torch.ones(100)
    message = expect_error((lambda: dist.broadcast(t, 0)) if odd else (lambda: dist.all_reduce(t)),
                           "mismatch", "all_reduce(float32, 100 elements, op=SUM)",
                           "broadcast(float32, 100 elements, root=0)", f"rank {size - 1}", within=10)
    ctx["mismatch_message"] = message
    # dtype
    expect_error(lambda: dist.all_reduce(torch.ones(50, dtype=torch.float64 if odd else torch.float32)),
                 "mismatch", "float64", "float32", within=10)
    # size, on the large (ring) path
    expect_error(lambda: dist.all_reduce(torch.ones(LARGE + (1 if odd else 0))),
                 "mismatch", f"{LARGE} elements", f"{LARGE + 1} elements", within=10)
    # root
    expect_error(lambda: dist.broadcast(torch.ones(10), src=1 if odd else 0), "mismatch", "root=0", "root=1", within=10)
    # uneven all-to-all whose splits disagree
    in_splits = [1] * size
    out_splits = [2 if (odd and r == 0) else 1 for r in range(size)]
    expect_error(lambda: dist.all_to_all_single(torch.empty(sum(out_splits)), torch.ones(size), out_splits, in_splits),
                 "mismatch", "sends 1 elements to rank", "expects 2", within=10)
    # the group stays usable after a mismatch
    t = torch.ones(3)
    dist.all_reduce(t)
    check_equal(t, torch.full((3,), float(size)), "all_reduce after mismatches")


def sc_send_recv_mismatch(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
    if rank == 0:  # sends more than the receiver expects: both sides fail
        expect_error(lambda: dist.send(torch.ones(12), 1, group=group), "send to rank 1", within=SHORT_TIMEOUT_S + 5)
    elif rank == 1:
        expect_error(lambda: dist.recv(torch.ones(10), 0, group=group), "mismatch", "float32[12]", "float32[10]",
                     within=SHORT_TIMEOUT_S + 5)
    dist.destroy_process_group(group)
    dist.barrier()


def sc_timeout(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
    t = torch.ones(10)
    dist.all_reduce(t, group=group)  # connections up
    if rank != size - 1:  # the last rank never joins the next collective
        message = expect_error(lambda: dist.all_reduce(t, group=group), "timed out", f"rank(s) {size - 1}",
                               within=SHORT_TIMEOUT_S + 5)
        assert "did not join" in message, message
        expect_error(lambda: dist.all_reduce(t, group=group), "earlier failure", within=2)
    dist.barrier()  # on the world group, unaffected; the last rank leaves the group only now
    dist.destroy_process_group(group)
    dist.barrier()


def sc_new_group(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    from torch_reccl.backend import Options

    evens = [r for r in range(size) if r % 2 == 0]
    odds = [r for r in range(size) if r % 2 == 1]
    g_even = dist.new_group(evens, pg_options=Options(channels=3, chunk_bytes=8192))
    g_odd = dist.new_group(odds)
    singles = [dist.new_group([r]) for r in range(size)] if size == 2 else None
    mine = evens if rank % 2 == 0 else odds
    group = g_even if rank % 2 == 0 else g_odd
    t = make_input(rank, LARGE, "float32")
    dist.all_reduce(t, group=group)
    check_equal(t, reference([make_input(r, LARGE, "float32") for r in mine], "SUM", "float32"), "new_group all_reduce")
    out = [torch.empty(4, dtype=torch.int64) for _ in mine]
    dist.all_gather(out, torch.full((4,), rank, dtype=torch.int64), group=group)
    check_equal(torch.stack(out), torch.tensor(mine).repeat_interleave(4).reshape(-1, 4), "new_group all_gather")
    if rank % 2 == 0:
        from torch_reccl.backend import backend_info

        info = backend_info(g_even)
        assert info["channels"] == 3 and info["chunk_bytes"] == 8192, info
    if singles is not None:
        u = torch.ones(5)
        dist.all_reduce(u, group=singles[rank])
        check_equal(u, torch.ones(5), "group of one")
        for g in singles:
            if g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
    dist.destroy_process_group(g_even if rank % 2 == 0 else g_odd)
    dist.barrier()


def sc_split(rank, size, ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    world = dist.group.WORLD
    first = list(range(size // 2))
    second = list(range(size // 2, size))
    mine = first if rank in first else second
    sub = world.split_group(mine, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                            group_name=f"split_{'a' if rank in first else 'b'}")
    t = torch.full((20000,), float(rank))
    sub.allreduce([t]).wait()
    check_equal(t, torch.full((20000,), float(sum(mine))), "split group all_reduce")
    sub.shutdown()
    dist.barrier()


def sc_ddp(rank, size, ctx):
    torch = ctx["torch"]
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

    def batch(step, r):
        g = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)

    ddp = DDP(model(), bucket_cap_mb=0.001)  # several buckets
    ref = model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ref_opt.zero_grad()
        xs, ys = zip(*[batch(step, r) for r in range(size)])
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        for p, q in zip(ddp.module.parameters(), ref.parameters()):
            if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"DDP gradient differs at step {step}: {(p.grad - q.grad).abs().max()}")
        opt.step()
        ref_opt.step()
    # a communication hook (fp16 compression) runs through the work futures
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooked = DDP(model())
    hooked.register_comm_hook(None, default_hooks.fp16_compress_hook)
    x, y = batch(9, rank)
    torch.nn.functional.mse_loss(hooked(x), y).backward()
    ref = model()
    xs, ys = zip(*[batch(9, r) for r in range(size)])
    torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    for p, q in zip(hooked.module.parameters(), ref.parameters()):
        if not torch.allclose(p.grad, q.grad, rtol=1e-2, atol=1e-3):
            raise AssertionError(f"DDP fp16 hook gradient differs: {(p.grad - q.grad).abs().max()}")


def sc_group_release(rank, size, ctx):
    """destroy_process_group(group) and abort release the group's threads and sockets."""
    torch, dist = ctx["torch"], ctx["dist"]
    from torch_reccl.backend import Options

    for how in ("destroy", "abort"):
        dist.barrier()
        threads0, sockets0 = native_threads(), open_sockets(ctx["port"])
        group = dist.new_group(list(range(size)), pg_options=Options(channels=3))
        t = torch.ones(LARGE)
        dist.all_reduce(t, group=group)  # every channel connected
        peer = (rank + 1) % size
        reqs = [dist.isend(torch.ones(4), peer, group=group),
                dist.irecv(torch.empty(4), (rank - 1) % size, group=group)]
        for req in reqs:
            req.wait()
        # Its connections are the group's own; threads need not be (an idle worker
        # or event loop left by earlier ops may serve it), so only sockets must grow.
        assert open_sockets(ctx["port"]) > sockets0, "the group opened no sockets?"
        if how == "destroy":
            dist.destroy_process_group(group)
        else:  # rank 0 aborts with an op pending (that rank 1 never joins), then rank 1 aborts
            if rank == 0:
                pending = dist.all_reduce(torch.ones(10), group=group, async_op=True)
                dist.distributed_c10d._abort_process_group(group)
                expect_error(pending.wait, "aborted", within=5)
            dist.barrier()
            if rank != 0:
                dist.distributed_c10d._abort_process_group(group)
        deadline = time.monotonic() + 5
        while True:
            threads, sockets = native_threads(), socket_table(ctx["port"])
            if (threads <= threads0 and len(sockets) <= sockets0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert threads <= threads0, f"{how}: {threads} threads left, {threads0} before"
        assert len(sockets) <= sockets0, f"{how}: {sockets} left, {sockets0} before"
        if how == "abort":
            expect_error(lambda: group.allreduce([torch.ones(1)]).wait(), "shut down or aborted")
    dist.barrier()


def sc_failover(rank, size, ctx):
    """Rank 0's primary NIC dies mid-run: collectives carry on over the backup NIC, bit-exact."""
    torch, dist = ctx["torch"], ctx["dist"]
    import torch_reccl

    n = 1 << 20
    dist.barrier()
    if rank == 0:
        torch_reccl.inject_fault("lo:127.0.0.1", "down")
    try:
        for step in range(3):
            t = torch.full((n,), float(rank + step))
            dist.all_reduce(t)
            check_equal(t, torch.full((n,), float(sum(r + step for r in range(size)))),
                        f"all_reduce during fault {step}")
            u = make_input(rank, 5000, "int64")
            out = torch.empty(size * 5000, dtype=torch.int64)
            dist.all_gather_into_tensor(out, u)
            check_equal(out, torch.cat([make_input(r, 5000, "int64") for r in range(size)]), "all_gather during fault")
    finally:
        if rank == 0:
            torch_reccl.inject_fault("lo:127.0.0.1", "up")
    dist.barrier()
    if rank == 0:
        nic = torch_reccl.stats()["nics"]["lo:127.0.0.1"]
        assert nic["failovers"] > 0, f"no failover recorded: {nic}"


def sc_nic_traffic(rank, size, ctx):
    import torch
    import torch.distributed as dist

    import torch_reccl

    def moved():
        stats = torch_reccl.stats()["nics"]
        return {name: s["bytes_sent"] + s["bytes_received"] for name, s in stats.items()}

    # Large all_reduces run one channel per NIC with equal shares (no fault): each
    # NIC must carry about half of what this window moved, not just something.
    # The failover scenario before this one healed its NIC: wait (bounded) until
    # every rank's channels are back on their primaries and the DCR plan in force
    # sends data on every channel again.
    from torch_reccl.backend import backend_info

    deadline = time.monotonic() + 15
    while True:
        info = backend_info()
        degraded = torch.tensor([len(info["channels_on_backup"]) + len(info["channels_without_data"])])
        dist.all_reduce(degraded, op=dist.ReduceOp.MAX)
        if degraded.item() == 0:
            break
        assert time.monotonic() < deadline, f"channels still degraded 15 s after the fault healed: {info}"
        time.sleep(0.1)
    before = moved()
    n = 1 << 21  # 8 MiB of float32
    for step in range(3):
        t = torch.full((n,), float(rank + step))
        dist.all_reduce(t)
        check_equal(t, torch.full((n,), float(sum(r + step for r in range(size)))), f"all_reduce {step}")
    after = moved()
    delta = {nic: after.get(nic, 0) - before.get(nic, 0) for nic in ("lo:127.0.0.1", "lo:127.0.0.2")}
    total = sum(delta.values())
    assert total >= 3 * n * 4, f"the window moved {total} bytes over both NICs, expected >= {3 * n * 4}: {delta}"
    for nic, nbytes in delta.items():
        share = nbytes / total
        assert 0.4 <= share <= 0.6, f"{nic} carried {share:.0%} of the window's bytes, expected 40-60%: {delta}"


SCENARIOS: Dict[str, Callable] = {
    "allreduce_all_ops_dtypes": sc_allreduce_all_ops_dtypes,
    "half_precision_bits": sc_half_precision_bits,
    "allreduce_async_future": sc_allreduce_async_future,
    "broadcast": sc_broadcast,
    "reduce": sc_reduce,
    "allgather": sc_allgather,
    "reduce_scatter": sc_reduce_scatter,
    "gather_scatter": sc_gather_scatter,
    "alltoall_uneven": sc_alltoall,
    "send_recv": sc_send_recv,
    "recv_any_source": sc_recv_any_source,
    "noncontiguous": sc_noncontiguous,
    "coalesced": sc_coalesced,
    "rejects_clearly": sc_rejects_clearly,
    "mismatch": sc_mismatch,
    "send_recv_mismatch": sc_send_recv_mismatch,
    "timeout": sc_timeout,
    "new_group": sc_new_group,
    "split": sc_split,
    "ddp": sc_ddp,
    "group_release": sc_group_release,
    "failover": sc_failover,
    "nic_traffic": sc_nic_traffic,
}
FOUR_RANK_SCENARIOS = ["allreduce_all_ops_dtypes", "allreduce_async_future", "broadcast", "reduce",
                       "allgather", "reduce_scatter", "gather_scatter", "alltoall_uneven", "send_recv",
                       "recv_any_source", "mismatch", "timeout", "new_group", "split", "ddp", "group_release"]


# --------------------------------------------------------------------------- the ranks


def rank_main(rank, size, mode, names, result_dir, port):
    os.environ.update({"RECCL_NICS": NICS, "RECCL_HEARTBEAT_MS": "500", "RECCL_NSOCKS": "2",
                       "RECCL_CONNECT_TIMEOUT_MS": "3000"})
    results = {"rank": rank, "scenarios": {}}
    port = port or None  # the store's port, whose sockets are not ours to count
    try:
        import torch
        import torch.distributed as dist

        import torch_reccl  # noqa: F401 - registers "reccl"
        from torch_reccl.backend import Options

        torch.set_num_threads(1)
        torch.ones(1000).sum()  # let torch start its own threads before the baseline
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        options = Options(chunk_bytes=16384, window=3)  # many chunks per ring step
        if mode == "file":
            store = dist.FileStore(os.path.join(result_dir, "store"), size)
            threads0, sockets0 = native_threads(), open_sockets(port)
            dist.init_process_group("reccl", store=store, rank=rank, world_size=size, timeout=timeout,
                                    pg_options=options)
        else:  # torchrun-style env://: the launcher (the test) hosts the store
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                               "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                               "TORCHELASTIC_USE_AGENT_STORE": "True"})
            store = None
            threads0, sockets0 = native_threads(), open_sockets(port)
            dist.init_process_group("reccl", init_method="env://", timeout=timeout, pg_options=options)
        assert dist.get_backend() == "reccl"
        ctx = {"torch": torch, "dist": dist, "port": port}
        for name in names:
            start = time.monotonic()
            try:
                SCENARIOS[name](rank, size, ctx)
                results["scenarios"][name] = {"ok": True, "s": time.monotonic() - start}
            except Exception:  # noqa: BLE001 - recorded for the test to report
                results["scenarios"][name] = {"ok": False, "error": traceback.format_exc(limit=6)}
        results["mismatch_message"] = ctx.get("mismatch_message")
        dist.destroy_process_group()
        __import__("gc").collect()  # DDP and process groups sit in reference cycles
        deadline = time.monotonic() + 5
        while True:  # threads and sockets go within moments; judge one consistent snapshot
            threads, sockets = native_threads(), socket_table(port)
            if (threads <= threads0 and len(sockets) <= sockets0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        results["threads"] = [threads0, threads]
        results["thread_names"] = sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                                         for t in os.listdir("/proc/self/task"))
        results["sockets"] = [sockets0, len(sockets)]
        results["socket_table"] = sockets
        results["reccl_threads"] = [t.name for t in __import__("threading").enumerate() if "reccl" in t.name]
        del store
    except Exception:  # noqa: BLE001
        results["fatal"] = traceback.format_exc()
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: faster, and nothing is left to release


def run_session(tmp_dir, size, mode, names) -> List[dict]:
    ctx = multiprocessing.get_context("spawn")
    store = None
    port = 0
    if mode == "env":  # like torchrun's agent: host the store, hand its port to the ranks
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, size + 1, True, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
        port = store.port
    procs = [ctx.Process(target=rank_main, args=(r, size, mode, names, str(tmp_dir), port), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SESSION_TIMEOUT_S
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    del store
    out = []
    for r in range(size):
        path = os.path.join(tmp_dir, f"rank{r}.json")
        missing = {"fatal": f"rank {r} wrote no result (killed after {SESSION_TIMEOUT_S} s?)"}
        out.append(json.load(open(path)) if os.path.exists(path) else missing)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_session(tmp_path_factory.mktemp("reccl2"), 2, "file", list(SCENARIOS))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_session(tmp_path_factory.mktemp("reccl4"), 4, "env", FOUR_RANK_SCENARIOS)


def assert_scenario(results, name):
    for r in results:
        assert "fatal" not in r, r["fatal"]
        got = r["scenarios"].get(name)
        assert got is not None, f"rank {r['rank']} did not run {name}"
        assert got["ok"], f"rank {r['rank']}:\n{got['error']}"


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks(two_ranks, name):
    assert_scenario(two_ranks, name)


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", FOUR_RANK_SCENARIOS)
def test_four_ranks_env_init(four_ranks, name):
    assert_scenario(four_ranks, name)


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
@pytest.mark.parametrize("session", ["two_ranks", "four_ranks"])
def test_destroy_releases_everything(session, request):
    for r in request.getfixturevalue(session):
        assert "fatal" not in r, r["fatal"]
        before, after = r["threads"]
        assert after <= before, (f"rank {r['rank']}: {after} native threads after destroy, {before} before init: "
                                 f"{r['thread_names']}")
        before, after = r["sockets"]
        assert after <= before, (f"rank {r['rank']}: {after} sockets after destroy, {before} before init: "
                                 f"{r['socket_table']}")
        assert not r["reccl_threads"], r["reccl_threads"]


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
def test_mismatch_message_names_both_sides(four_ranks):
    messages = [r["mismatch_message"] for r in four_ranks]
    assert all(messages), messages
    assert len(set(messages)) == 1, f"ranks disagree on the error: {messages}"
    assert "rank 0 called all_reduce" in messages[0] and "rank 3 called broadcast" in messages[0], messages[0]
