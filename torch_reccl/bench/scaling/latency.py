"""Small-message latency in bench/scale.py's jobs: the 4-byte all_reduce on the world group.

Per rank: the median of --small-iters timed ops after --warmup, each result checked;
reported: the max over ranks of the per-rank medians (and the median of them).
"""
from __future__ import annotations

import statistics
import time


def rank_phase(ctx, warmup: int, small_iters: int) -> None:
    """Rank side of the collectives phase."""
    import torch
    import torch.distributed as dist

    ctx.command("collectives")
    small = torch.zeros(1)
    want = float(ctx.size * (ctx.size + 1) // 2)
    times = []
    for i in range(warmup + small_iters):
        small.fill_(float(ctx.rank + 1))
        t0 = time.perf_counter()
        dist.all_reduce(small)
        dt = time.perf_counter() - t0
        if small.item() != want and len(ctx.errors) < 20:
            ctx.errors.append(f"4-byte all_reduce {i}: got {small.item()}, expected {want}")
        if i >= warmup:
            times.append(dt)
    small_median = statistics.median(times)
    ctx.progress("4-byte all_reduces done")
    ctx.emit("collectives", small_median_s=small_median, small_times=times, errors=ctx.new_errors())


def record(job, result: dict) -> None:
    """Launcher side of the collectives phase."""
    replies, _ = job.step("collectives")
    medians = [m["small_median_s"] for m in replies.values()]
    result["latency_4b_s"] = max(medians)
    result["latency_4b_median_of_ranks_s"] = statistics.median(medians) if medians else None
    result["errors"] += job.errors(replies)
