"""Group set-up in bench/scale.py's jobs: init_process_group, a Megatron-like group set,
and each group's first use, each phase timed on the ranks (slowest rank) and by the
launcher (wall), with the store keys left after it.

    init         TCPStore client through the proxy, init_process_group
    create       world, tensor-parallel pairs (2k, 2k+1), data-parallel groups (ranks
                 with equal r % 2), 4 more world-sized groups: 1 + N/2 + 2 + 4 groups
                 in the job, 7 per rank
    first_use    one small all_reduce on every group the rank is in (exact check)
"""
from __future__ import annotations

import os
import time
from typing import List, Tuple


def group_layout(size: int) -> List[Tuple[str, List[int]]]:
    """The Megatron-like groups every rank creates, in creation order (world excluded)."""
    groups = [(f"tp{k}", [2 * k, 2 * k + 1]) for k in range(size // 2)]
    groups += [(f"dp{j}", list(range(j, size, 2))) for j in range(2)]
    groups += [(f"world{i}", list(range(size))) for i in range(4)]
    return groups


def thread_count() -> int:
    """Threads of this process now."""
    return len(os.listdir("/proc/self/task"))


def rank_phases(ctx, backend: str, store_port: int, timeout) -> None:
    """Rank side of init, create and first_use."""
    import torch
    import torch.distributed as dist

    rank, size = ctx.rank, ctx.size
    ctx.command("init")
    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", store_port, size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    ctx.emit("init", s=time.perf_counter() - t0, threads=thread_count())

    ctx.command("create")
    t0 = time.perf_counter()
    mine = [("world", list(range(size)), dist.group.WORLD)]
    for name, ranks in group_layout(size):
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine.append((name, ranks, pg))
    ctx.emit("create", s=time.perf_counter() - t0, groups=[m[0] for m in mine], threads=thread_count())

    ctx.command("first_use")
    t0 = time.perf_counter()
    per_group = {}
    for name, ranks, pg in mine:
        g0 = time.perf_counter()
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        per_group[name] = time.perf_counter() - g0
        ctx.progress(f"first use of {name} done")
        expected = torch.full((3,), float(sum(r + 1 for r in ranks)))
        if not torch.equal(t, expected):
            ctx.errors.append(f"first use of {name}: got {t.tolist()}, expected {expected.tolist()}")
    ctx.emit("first_use", s=time.perf_counter() - t0, per_group=per_group, errors=ctx.new_errors(),
             threads=thread_count())


def record(job, result: dict) -> None:
    """Launcher side of init, create and first_use: their times (slowest rank, and wall)
    and the store keys left after each."""
    replies, wall_s = job.step("init")
    result["init_s"] = max(m["s"] for m in replies.values())
    result["init_wall_s"] = wall_s

    replies, wall_s = job.step("create")
    result["create_s"] = max(m["s"] for m in replies.values())
    result["create_wall_s"] = wall_s
    result["store_keys_after_create"] = job.store.num_keys()

    replies, wall_s = job.step("first_use")
    result["first_use_s"] = max(m["s"] for m in replies.values())
    result["first_use_wall_s"] = wall_s
    result["setup_s"] = result["create_s"] + result["first_use_s"]
    result["first_use_per_group_s"] = {
        name: max(m["per_group"].get(name, 0.0) for m in replies.values())
        for name in replies[0]["per_group"]}
    result["errors"] = job.errors(replies)
    result["store_keys_after_first_use"] = job.store.num_keys()
