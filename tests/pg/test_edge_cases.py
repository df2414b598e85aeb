"""Edge cases of the "reccl" backend that must neither hang nor break the group.

Zero elements: every point-to-point op (send/recv, isend/irecv, batch_isend_irecv,
recv from any source) and every collective with empty tensors, at 2 and 3 ranks,
with each algorithm (recursive doubling and the channels, RECCL_SMALL_BYTES 0).
Each is followed by a real op on the same group whose result is checked exactly,
so a zero-byte message that was lost, or matched the wrong receive, fails the
test. The same scenarios run on a Gloo group of the same ranks in the same job,
the behaviour reccl must match (Gloo completes every one at once, except a
0-element recv from any source, which Gloo rejects: "enforce fail ...
unbound_buffer.cc: offset < this->size"; reccl completes it).

Invalid arguments only one rank can see (a scatter_list or gather_list of the
wrong length or size on the root, wrong list lengths, sizes and split sizes on
one rank): every rank fails the op at once with the same message naming that
rank and the problem, and the group stays usable (a checked op after each);
also in a group of one, which runs no agreement.

One spawned job of 3 ranks per algorithm runs every scenario on the groups of
ranks {0, 1} and {0, 1, 2}; every scenario is bounded by a short group timeout,
so a hang shows as a timeout error naming the scenario, not a stuck test.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import pytest

from conftest import reccl_env, run_rank_job

WORLD = 3
GROUP_SIZES = (2, 3)
ALGORITHMS = {"by-size": 65536, "channels": 0}
OP_TIMEOUT_S = 10              # a zero-element op that hangs fails after this
JOB_TIMEOUT_S = 150


def check(got, expected, what):
    import torch

    if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(got, expected):
        raise AssertionError(f"{what}: got {got.tolist()} ({got.dtype}, {tuple(got.shape)}), "
                             f"expected {expected.tolist()} ({expected.dtype}, {tuple(expected.shape)})")


def values(rank, n, salt=0):
    """Small exact integers as float32, distinct per rank and salt."""
    import torch

    return torch.arange(n, dtype=torch.float32) + 100 * rank + 10 * salt


def check_group_works(rank, k, group, dist, torch, what):
    """A real all_reduce on the group, checked exactly: the group still works."""
    t = values(rank, 5, salt=1)
    dist.all_reduce(t, group=group)
    check(t, sum(values(r, 5, salt=1) for r in range(k)), f"all_reduce after {what}")


def zero_p2p(rank, k, group, dist, torch, any_source):
    """Point-to-point with empty tensors, each followed by a real message on the
    same pair (a lost or misordered zero-byte message would take its place)."""
    empty = lambda: torch.empty(0)  # noqa: E731
    peer = lambda r: dist.get_global_rank(group, r)  # noqa: E731
    nxt, prv = (rank + 1) % k, (rank - 1) % k

    # Blocking send/recv between ranks 0 and 1, both ways.
    if rank in (0, 1):
        other = 1 - rank
        for sender in (0, 1):
            if rank == sender:
                dist.send(empty(), peer(other), group=group)
                dist.send(values(rank, 4), peer(other), group=group)
            else:
                got = torch.full((0,), 7.0)
                dist.recv(got, peer(other), group=group)
                check(got, torch.empty(0), "recv of 0 elements")
                real = torch.empty(4)
                dist.recv(real, peer(other), group=group)
                check(real, values(other, 4), "recv after a 0-element recv")

    # isend/irecv around the ring: a zero-element message then a real one, posted at once.
    reqs = [dist.isend(empty(), peer(nxt), group=group, tag=3),
            dist.isend(values(rank, 6), peer(nxt), group=group, tag=3)]
    got_empty, got_real = torch.empty(0), torch.empty(6)
    reqs += [dist.irecv(got_empty, peer(prv), group=group, tag=3),
             dist.irecv(got_real, peer(prv), group=group, tag=3)]
    for req in reqs:
        req.wait()
    check(got_real, values(prv, 6), "irecv after a 0-element irecv")

    # batch_isend_irecv with every peer: an empty message and a real one each way.
    ops, got = [], {}
    for r in range(k):
        if r != rank:
            got[r] = (torch.empty(0), torch.empty(3))
            ops += [dist.P2POp(dist.isend, empty(), peer(r), group),
                    dist.P2POp(dist.isend, values(rank, 3, salt=r), peer(r), group),
                    dist.P2POp(dist.irecv, got[r][0], peer(r), group),
                    dist.P2POp(dist.irecv, got[r][1], peer(r), group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for r, (_zero, real) in got.items():
        check(real, values(r, 3, salt=rank), f"batch_isend_irecv from {r} after a 0-element message")

    # recv from any source: rank 1 sends an empty tensor to rank 0, then a real one.
    if not any_source:
        return
    if rank == 1:
        dist.send(empty(), peer(0), group=group, tag=9)
        dist.send(values(rank, 2), peer(0), group=group, tag=9)
    elif rank == 0:
        source = dist.recv(torch.empty(0), group=group, tag=9)
        if source != peer(1):
            raise AssertionError(f"recv of 0 elements from any source says rank {source}, expected {peer(1)}")
        real = torch.empty(2)
        dist.recv(real, peer(1), group=group, tag=9)
        check(real, values(1, 2), "recv after a 0-element recv from any source")


def uneven_splits(sender, receiver):
    """Rows sender sends receiver: zero for some pairs, including a rank and itself."""
    return (sender + 2 * receiver) % 3


def zero_collectives(rank, k, group, dist, torch):
    """Every collective with 0 elements, each followed by a checked all_reduce.
    Yields the name of each op as it completes (for the error report)."""
    empty = lambda: torch.empty(0)  # noqa: E731
    empties = lambda: [empty() for _ in range(k)]  # noqa: E731
    root_rank = lambda r: dist.get_global_rank(group, r)  # noqa: E731
    ops = {
        "all_reduce": lambda: dist.all_reduce(empty(), group=group),
        "all_reduce MAX int64": lambda: dist.all_reduce(torch.empty(0, dtype=torch.int64),
                                                        op=dist.ReduceOp.MAX, group=group),
        "all_gather": lambda: dist.all_gather(empties(), empty(), group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(empty(), empty(), group=group),
        "reduce_scatter": lambda: dist.reduce_scatter(empty(), empties(), group=group),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(empty(), empty(), group=group),
        "all_to_all": lambda: dist.all_to_all(empties(), empties(), group=group),
        "all_to_all_single": lambda: dist.all_to_all_single(empty(), empty(), group=group),
        "all_to_all_single 0x4": lambda: dist.all_to_all_single(torch.empty(0, 4), torch.empty(0, 4),
                                                                [0] * k, [0] * k, group=group),
        "barrier": lambda: dist.barrier(group=group),
    }
    for root in (0, k - 1):
        ops.update({
            f"broadcast root={root}": lambda root=root: dist.broadcast(empty(), root_rank(root), group=group),
            f"reduce root={root}": lambda root=root: dist.reduce(empty(), root_rank(root), group=group),
            f"gather root={root}": lambda root=root: dist.gather(
                empty(), empties() if rank == root else None, root_rank(root), group=group),
            f"scatter root={root}": lambda root=root: dist.scatter(
                empty(), empties() if rank == root else None, root_rank(root), group=group),
        })
    for name, op in ops.items():
        op()
        check_group_works(rank, k, group, dist, torch, f"{name} of 0 elements")
        yield name

    # Uneven all_to_all_single where some parts (and one rank's whole input) are empty.
    for rows_of in (uneven_splits, lambda s, r: 0 if s == 0 else uneven_splits(s, r)):
        in_splits = [rows_of(rank, r) for r in range(k)]
        out_splits = [rows_of(r, rank) for r in range(k)]
        inp = torch.cat([values(rank, 2 * in_splits[r], salt=r) for r in range(k)]).reshape(-1, 2)
        out = torch.full((sum(out_splits), 2), -1.0)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        expected = torch.cat([values(r, 2 * out_splits[r], salt=rank) for r in range(k)]).reshape(-1, 2)
        check(out, expected, f"uneven all_to_all_single (splits {in_splits})")
        check_group_works(rank, k, group, dist, torch, "uneven all_to_all_single with empty parts")
        yield "all_to_all_single uneven"


def expect_rejection(fn, *needles):
    """Runs fn; it must fail well before the op timeout, naming every needle.
    Returns the message."""
    started = time.monotonic()
    try:
        fn()
    except RuntimeError as error:
        message = str(error)
        missing = [n for n in needles if n not in message]
        if missing:
            raise AssertionError(f"error lacks {missing}: {message}") from error
        if time.monotonic() - started > OP_TIMEOUT_S / 2:
            raise AssertionError(f"the error came after {time.monotonic() - started:.1f} s: {message}")
        return message.splitlines()[0]
    raise AssertionError(f"no error raised; expected one naming {needles}")


def entries(n):
    return f"{n} entry" if n == 1 else f"{n} entries"


def invalid_arguments(rank, k, group, dist, torch):
    """Lists of the wrong length or tensors of the wrong size on one rank: every
    rank fails that op at once with the same message naming the rank and the
    problem, and the group stays usable (a checked all_reduce after each).
    Returns {case: message}."""
    cpu = lambda n: torch.zeros(n)  # noqa: E731
    g = lambda r: dist.get_global_rank(group, r)  # noqa: E731
    last = k - 1
    messages = {}

    def case(name, fn, *needles):
        messages[name] = expect_rejection(fn, "invalid arguments", *needles,
                                          "Every rank fails this op at once; the group stays usable")
        check_group_works(rank, k, group, dist, torch, f"rejected {name}")

    for root in (0, last):  # the lowest rank's descriptor, and a higher rank's
        case(f"scatter root={root} short list",
             lambda: dist.scatter(cpu(4), [cpu(4)] * (k - 1) if rank == root else None, g(root), group=group),
             f"rank {root} called scatter(float32, 4 elements, root={root})",
             f"scatter_list has {entries(k - 1)}, expected {k}")
        case(f"scatter root={root} wrong shape",
             lambda: dist.scatter(cpu(4), [cpu(4), cpu(3)] + [cpu(4)] * (k - 2) if rank == root else None,
                                  g(root), group=group),
             f"rank {root} called scatter", "scatter_list[1] has 3 elements, expected 4")
        case(f"gather root={root} long list",
             lambda: dist.gather(cpu(2), [cpu(2)] * (k + 1) if rank == root else None, g(root), group=group),
             f"rank {root} called gather(float32, 2 elements, root={root})",
             f"gather_list has {entries(k + 1)}, expected {k}")
        case(f"gather root={root} wrong shape",
             lambda: dist.gather(cpu(2), [cpu(2)] * (k - 1) + [cpu(5)] if rank == root else None,
                                 g(root), group=group),
             f"gather_list[{k - 1}] has 5 elements, expected 2")

    # A list given to a non-root rank (torch.distributed stops it in Python; the
    # backend's own API does not): the last rank calls the group's scatter directly.
    def scatter_with_list_off_root():
        if rank == last:
            opts = dist.ScatterOptions()
            opts.rootRank = 0
            group.scatter([cpu(3)], [[cpu(3)] * k], opts).wait()
        else:
            dist.scatter(cpu(3), [cpu(3)] * k if rank == 0 else None, g(0), group=group)
    case("scatter list off the root", scatter_with_list_off_root,
         f"rank {last} called scatter", f"scatter_list ({k} tensors) was given on a rank that is not the root")

    case("all_gather short list on the last rank",
         lambda: dist.all_gather([cpu(3)] * (k - 1 if rank == last else k), cpu(3), group=group),
         f"rank {last} called all_gather", f"tensor_list has {entries(k - 1)}, expected {k}")
    case("all_gather_into_tensor wrong output on rank 0",
         lambda: dist.all_gather_into_tensor(cpu(3 * k + (1 if rank == 0 else 0)), cpu(3), group=group),
         "rank 0 called all_gather", f"output_tensor has {3 * k + 1} elements, expected {3 * k}")
    case("reduce_scatter long list on the last rank",
         lambda: dist.reduce_scatter(cpu(2), [cpu(2)] * (k + 1 if rank == last else k), group=group),
         f"rank {last} called reduce_scatter", f"input_list has {entries(k + 1)}, expected {k}")
    case("reduce_scatter_tensor wrong input on the last rank",
         lambda: dist.reduce_scatter_tensor(cpu(2), cpu(2 * k - (1 if rank == last else 0)), group=group),
         f"rank {last} called reduce_scatter", f"input has {2 * k - 1} elements, expected {2 * k}")
    case("all_to_all short input list on rank 0",
         lambda: dist.all_to_all([cpu(1)] * k, [cpu(1)] * (k - 1 if rank == 0 else k), group=group),
         "rank 0 called all_to_all", f"input_tensor_list has {entries(k - 1)}, expected {k}")
    case("all_to_all_single splits that do not add up on the last rank",
         lambda: dist.all_to_all_single(cpu(k), cpu(k), [1] * k,
                                        [2] + [1] * (k - 1) if rank == last else [1] * k, group=group),
         f"rank {last} called all_to_all", f"input_split_sizes add up to {k + 1}, not to the tensor's {k} rows")
    case("all_to_all_single indivisible on rank 0",
         lambda: dist.all_to_all_single(cpu(k), cpu(k + (1 if rank == 0 else 0)), group=group),
         "rank 0 called all_to_all", f"input has {k + 1} elements, which do not divide evenly over {k} ranks")
    if k >= 3:  # two ranks reject: every rank names the lower one
        case("all_gather rejected on two ranks",
             lambda: dist.all_gather([cpu(1)] * (k + rank if rank >= 1 else k), cpu(1), group=group),
             "rank 1 called all_gather", f"tensor_list has {entries(k + 1)}, expected {k}")
    return messages


def rank_main(rank, port, out_dir, small_bytes):
    os.environ.update(reccl_env(SMALL_BYTES=small_bytes))
    result = {"rank": rank}
    scenario = "init"
    try:
        import torch
        import torch.distributed as dist

        import torch_reccl  # noqa: F401

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, WORLD, False, timeout=datetime.timedelta(seconds=90))
        timeout = datetime.timedelta(seconds=OP_TIMEOUT_S)
        dist.init_process_group("reccl", store=store, rank=rank, world_size=WORLD, timeout=timeout)
        groups = {(backend, k): dist.new_group(list(range(k)), timeout=timeout, backend=backend)
                  for backend in ("reccl", "gloo") for k in GROUP_SIZES}
        times = {}
        for (backend, k), group in groups.items():
            if rank < k:
                started = time.monotonic()
                scenario = f"{backend} k={k} zero-element p2p"
                zero_p2p(rank, k, group, dist, torch, any_source=backend == "reccl")
                check_group_works(rank, k, group, dist, torch, scenario)
                for name in zero_collectives(rank, k, group, dist, torch):
                    scenario = f"{backend} k={k} after zero-element {name}"
                times[f"{backend} k={k}"] = time.monotonic() - started
                if backend == "reccl":
                    scenario = f"reccl k={k} invalid arguments"
                    result[f"rejections k={k}"] = invalid_arguments(rank, k, group, dist, torch)
            scenario = f"barrier after {backend} k={k}"
            dist.barrier()
        result["seconds"] = times
        # A group of one runs no agreement: the rejection is raised all the same.
        scenario = "invalid arguments in a group of one"
        alone = dist.new_group([0], timeout=timeout)
        if rank == 0:
            expect_rejection(lambda: dist.scatter(torch.zeros(2), [torch.zeros(2)] * 2, 0, group=alone),
                             "invalid arguments", "rank 0 called scatter", "scatter_list has 2 entries, expected 1")
            check_group_works(rank, 1, alone, dist, torch, scenario)
        dist.destroy_process_group()
        result["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = f"in scenario '{scenario}':\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_zero_elements_everywhere(tmp_path, algorithm):
    results = run_rank_job(tmp_path, rank_main, WORLD, (ALGORITHMS[algorithm],), JOB_TIMEOUT_S)
    # Nothing waited for a timeout: every scenario of a group finishes in far
    # less than one op timeout (a hung zero-byte message costs OP_TIMEOUT_S).
    for result in results:
        for where, seconds in result["seconds"].items():
            assert seconds < OP_TIMEOUT_S, (result["rank"], where, seconds)
    # A rejection fails every rank with the same message.
    for k in GROUP_SIZES:
        per_rank = [r[f"rejections k={k}"] for r in results[:k]]
        for case in per_rank[0]:
            assert len({m[case] for m in per_rank}) == 1, (k, case, [m[case] for m in per_rank])
