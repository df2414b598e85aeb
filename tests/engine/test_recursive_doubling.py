"""The per-op agreement and small collectives by recursive doubling, at group
sizes that are not powers of two (the first 2(N-p) ranks fold in pairs first and
get the result back last), against local references, bit for bit.

One spawned job of 6 ranks runs every collective on groups of 3, 5 and 6 ranks,
small (recursive doubling) and large (rings and direct transfers), checks that a
mismatch names the same two ranks on every rank, and that a rank that never joins
(a folded-out one, so the verdict must travel through its fold partner) is named
by every other rank. Inputs are small integers, so every reduction is exact.
The job runs three times: algorithms chosen by size, every size forced through
the channels, and every size forced through recursive doubling.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import time
import traceback

import pytest

WORLD = 6
SIZES = (3, 5, 6)
NICS = "127.0.0.1,127.0.0.2"
SMALL, LARGE = 5, 40000          # 20 B by recursive doubling; 160 KB by the channels


def inputs(rank, n, salt):
    import torch

    g = torch.Generator().manual_seed(7919 * salt + 31 * rank + n)
    return torch.randint(-3, 4, (n,), generator=g).to(torch.float32)


def check(got, expected, what):
    import torch

    if got.shape != expected.shape or not torch.equal(got, expected):
        raise AssertionError(f"{what}: differs ({got[:8].tolist()} vs {expected[:8].tolist()})")


def run_group(rank, k, dist, torch):
    group = dist.new_group(list(range(k)), timeout=datetime.timedelta(seconds=5))
    if rank >= k:
        return
    every = lambda n, salt: [inputs(r, n, salt) for r in range(k)]  # noqa: E731
    for n in (SMALL, LARGE):
        salt = k * 100 + n
        xs = every(n, salt)
        t = xs[rank].clone()
        dist.all_reduce(t, group=group)
        check(t, torch.stack(xs).sum(0), f"all_reduce k={k} n={n}")
        t = xs[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        check(t, torch.stack(xs).amax(0), f"all_reduce max k={k} n={n}")
        for root in (0, k - 1):
            t = xs[rank].clone()
            dist.broadcast(t, src=root, group=group)
            check(t, xs[root], f"broadcast k={k} n={n} root={root}")
            t = xs[rank].clone()
            dist.reduce(t, dst=root, group=group)
            check(t, torch.stack(xs).sum(0) if rank == root else xs[rank], f"reduce k={k} n={n}")
            outs = [torch.empty(n) for _ in range(k)] if rank == root else None
            dist.gather(xs[rank], outs, dst=root, group=group)
            if rank == root:
                for r in range(k):
                    check(outs[r], xs[r], f"gather k={k} n={n} from {r}")
            out = torch.empty(n)
            dist.scatter(out, [every(n, salt + r)[r] for r in range(k)] if rank == root else None,
                         src=root, group=group)
            check(out, every(n, salt + rank)[rank], f"scatter k={k} n={n}")
        outs = [torch.empty(n) for _ in range(k)]
        dist.all_gather(outs, xs[rank], group=group)
        for r in range(k):
            check(outs[r], xs[r], f"all_gather k={k} n={n} from {r}")
        blocks = [inputs(rank * 10 + r, n, salt) for r in range(k)]
        out = torch.empty(n)
        dist.reduce_scatter(out, blocks, group=group)
        check(out, torch.stack([inputs(r * 10 + rank, n, salt) for r in range(k)]).sum(0),
              f"reduce_scatter k={k} n={n}")
    dist.barrier(group=group)
    # A mismatch: the last rank calls broadcast; every rank names ranks 0 and k-1.
    t = torch.ones(SMALL)
    try:
        if rank == k - 1:
            dist.broadcast(t, src=0, group=group)
        else:
            dist.all_reduce(t, group=group)
        raise AssertionError(f"k={k}: no mismatch raised")
    except RuntimeError as error:
        message = str(error)
        if "rank 0 called all_reduce" not in message or f"rank {k - 1} called broadcast" not in message:
            raise AssertionError(f"k={k}: mismatch message: {message}") from error
    t = torch.ones(SMALL)
    dist.all_reduce(t, group=group)  # the group is still usable
    check(t, torch.full((SMALL,), float(k)), f"all_reduce after a mismatch k={k}")
    # Rank 0 folds into rank 1 (k = 3, 5, 6 are not powers of two): when it
    # never joins, its fold partner must tell everyone else who is missing.
    if rank != 0:
        try:
            dist.all_reduce(torch.ones(SMALL), group=group)
            raise AssertionError(f"k={k}: no timeout raised")
        except RuntimeError as error:
            message = str(error)
            if "rank(s) 0 did not join" not in message:
                raise AssertionError(f"k={k}: timeout message: {message}") from error


def rank_main(rank, port, out_dir, small_bytes):
    os.environ.update({"RECCL_NICS": NICS, "RECCL_SMALL_BYTES": str(small_bytes)})
    result = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist

        import torch_reccl  # noqa: F401

        store = dist.TCPStore("127.0.0.1", port, WORLD, False, timeout=datetime.timedelta(seconds=90))
        dist.init_process_group("reccl", store=store, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        for k in SIZES:
            run_group(rank, k, dist, torch)
            dist.barrier()
            result[f"k{k}"] = "ok"
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


# The algorithm is chosen by size: the default sends SMALL by recursive doubling
# and LARGE by the channels; 0 forces the channels (rings, chains, direct) for
# every size, 4 MiB forces recursive doubling for every size here.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("small_bytes", [65536, 0, 4 << 20], ids=["by-size", "channels", "recursive-doubling"])
def test_groups_of_three_five_and_six_ranks(tmp_path, small_bytes):
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, WORLD + 1, True, timeout=datetime.timedelta(seconds=90),
                         wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, host.port, str(tmp_path), small_bytes), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 220
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
        assert not p.is_alive(), "a rank hung"
    for r in range(WORLD):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in result, result["error"]
        assert all(result[f"k{k}"] == "ok" for k in SIZES), result
