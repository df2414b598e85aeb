"""Bus bandwidth in bench/scale.py's jobs: which (op, size) run how many ops, each rank's
checked and timed loop, and the busbw the launcher derives from the ranks' times.

One phase per (op, size) on the world group: per rank, the untimed ops, each checked
bit for bit, a barrier, the timed ops back to back (as nccl-tests), then one more
checked op; t = the max over ranks of the loop's time per op; busbw as nccl-tests.
The shapes, bus factors and collective calls are those of torch_reccl/bench/rank.py
(``reccl bench``).
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

from torch_reccl.bench import procstat
from torch_reccl.bench.rank import OPS, bus_factor, run_collective, shape_for

# --------------------------------------------------------------------------- busbw plan

BUSBW_REFERENCE_BYTES = 16 << 20  # --busbw-iters and --warmup/2 are the counts at this size


def busbw_counts(size_bytes: int, iters: int, warmup: int) -> Tuple[int, int]:
    """(untimed, timed) ops of one busbw measurement of ``size_bytes``.

    At 16 MiB: max(1, warmup // 2) untimed and ``iters`` timed, as before sizes were
    configurable. Other sizes scale both by 16 MiB / size, so every size moves about
    the same bytes: timed ops between min(2, iters) and 4 x iters, untimed between 1
    and max(1, warmup // 2). The counts depend on the size only, never on N or the
    backend, so reccl and Gloo run the same ops.
    """
    scale = BUSBW_REFERENCE_BYTES / max(1, size_bytes)
    warm = max(1, warmup // 2)
    return (max(1, min(warm, round(warm * scale))),
            max(min(2, iters), min(4 * iters, round(iters * scale))))


def busbw_plan(ops, sizes_bytes, iters: int, warmup: int) -> List[dict]:
    """Every (op, size) to measure, ops outer, sizes inner, with its op counts."""
    plan = []
    for op in ops:
        if op not in OPS:
            raise ValueError(f"busbw op {op!r}: expected one of {OPS}")
        for size in sizes_bytes:
            warm, timed = busbw_counts(int(size), iters, warmup)
            plan.append({"op": op, "size_bytes": int(size), "warmup": warm, "iters": timed})
    return plan


def human_bytes(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else (f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B")

# --------------------------------------------------------------------------- the rank's loop

PATTERN = 251       # inputs: (global element index % 251) + rank; every sum is an exact float32 integer
CHECK_CHUNK = 1 << 20  # elements compared per step: the check's temporaries stay 8 MiB whatever the size


def _pattern(count: int):
    """uint8 tensor of (i % 251) for i < count: the inputs' shape, a quarter of a float32 buffer."""
    import torch

    return torch.arange(PATTERN, dtype=torch.uint8).repeat(-(-count // PATTERN))[:count]


def _first_wrong(segments) -> Optional[Tuple[int, float, float]]:
    """(output index, got, expected) of the first element that is not base x scale + offset in
    any (output slice, output start, base slice, scale, offset) segment; None if all are right."""
    import torch

    for out, start, base, scale, offset in segments:
        for a in range(0, out.numel(), CHECK_CHUNK):
            b = min(a + CHECK_CHUNK, out.numel())
            want = base[a:b].float().mul_(scale).add_(offset)
            if not torch.equal(out[a:b], want):
                bad = int((out[a:b] != want).nonzero()[0].item())
                return start + a + bad, out[a + bad].item(), want[bad].item()
    return None


def measure_busbw(op: str, nominal: int, warm: int, iters: int, rank: int, size: int, errors: List[str],
                  progress=None) -> dict:
    """``warm`` untimed ops, each checked bit for bit, then ``iters`` back-to-back timed
    ops, then one more checked op; as nccl-tests, which time a loop and check apart.

    Shapes as nccl-tests (shape_for): ``nominal`` bytes is the largest buffer, the
    all_reduce buffer, the all_gather output, the reduce_scatter input; all_gather's
    input and reduce_scatter's output are 1/N of it. So a rank holds about 1.25 x
    the size (the buffer(s) plus a uint8 copy of the pattern), whatever N.
    Before every checked op the input is refilled and an all_gather/reduce_scatter
    output set to -1 (never a right value), so a result the op did not write is caught.
    The timed ops run back to back on the buffers as they are (an in-place all_reduce
    keeps summing), after a barrier so every rank starts the loop together: timing
    each op alone, with a refill and a check between, measured the ranks' skew as
    much as the op. Returns the mean time per timed op, its CPU
    (this process, every thread) and the shapes.
    """
    import torch
    import torch.distributed as dist

    count, nbytes, n_in, n_out = shape_for(op, nominal, size, "float32")
    chunk = count // size
    base = _pattern(count)
    total = float(size * (size - 1) // 2)   # sum over ranks of the "+ rank" offsets
    if op == "all_reduce":
        inp = out = torch.empty(count)
        mine = base
        segments = [(out, 0, base, float(size), total)]
    elif op == "all_gather":
        inp, out = torch.empty(chunk), torch.empty(count)
        mine = base[rank * chunk:(rank + 1) * chunk]
        segments = [(out[k * chunk:(k + 1) * chunk], k * chunk, base[k * chunk:(k + 1) * chunk], 1.0, float(k))
                    for k in range(size)]
    else:
        inp, out = torch.empty(count), torch.empty(chunk)
        mine = base
        segments = [(out, 0, base[rank * chunk:(rank + 1) * chunk], float(size), total)]
    found = 0

    def checked(i: int) -> None:
        nonlocal found
        inp.copy_(mine).add_(rank)
        if out is not inp:
            out.fill_(-1.0)
        run_collective(op, out, inp)
        wrong = _first_wrong(segments)
        if wrong is not None and found < 5 and len(errors) < 20:
            found += 1
            errors.append(f"{op} of {nbytes} bytes, op {i}: output element {wrong[0]} is {wrong[1]}, "
                          f"expected {wrong[2]}")
        if progress:
            progress(f"{op} {nbytes} B op {i} checked")

    for i in range(warm):
        checked(i)
    if dist.is_initialized():
        dist.barrier()
    threads_before = procstat.threads()
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(iters):
        run_collective(op, out, inp)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    by_thread = procstat.cpu_ms_by_name(threads_before, procstat.threads(), iters)
    if progress:
        progress(f"{op} {nbytes} B: {iters} timed ops done")
    checked(warm + iters)
    return {"op": op, "size_bytes": nominal, "bytes": nbytes, "in_count": n_in, "out_count": n_out,
            "mean_s": elapsed / iters, "cpu_s_per_op": cpu / iters,
            "cpu_ms_per_op_by_thread": {name: ms for name, ms in by_thread.items() if ms[0] + ms[1] > 0}}


# --------------------------------------------------------------------------- the phases

def rank_phases(ctx, plan: List[List]) -> None:
    """Rank side: one phase per [op, size bytes, untimed, timed] of the plan."""
    for i, (op, nominal, warm, iters) in enumerate(plan):
        ctx.command(f"busbw{i}", f"busbw {op} {nominal} B")
        measured = measure_busbw(op, nominal, warm, iters, ctx.rank, ctx.size, ctx.errors, ctx.progress)
        ctx.emit(f"busbw{i}", **measured, errors=ctx.new_errors())


def record(job, plan: List[dict], result: dict) -> None:
    """Launcher side: runs the plan's phases; per (op, size) the slowest rank's time,
    algbw, busbw and the CPU the op kept busy, in result["busbw"]."""
    size = job.size
    result["busbw"] = []
    for i, entry in enumerate(plan):
        replies, _ = job.step(f"busbw {entry['op']} {human_bytes(entry['size_bytes'])}", f"busbw{i}")
        per_rank = [replies[r]["mean_s"] for r in range(size)]
        slowest = max(per_rank)
        nbytes = replies[0]["bytes"]
        algbw = nbytes / slowest / 1e9
        # CPU of every thread of every rank per op, against the op's time: how many of
        # the machine's cores the op kept busy (near all of them: the machine is the limit).
        cpu_per_op = sum(replies[r]["cpu_s_per_op"] for r in range(size))
        result["busbw"].append({
            "cpu_s_per_op": cpu_per_op, "cores_busy": cpu_per_op / slowest,
            **entry, "bytes": nbytes, "in_count": replies[0]["in_count"],
            "out_count": replies[0]["out_count"], "time_s": slowest, "mean_s_per_rank": per_rank,
            "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(entry["op"], size),
            # Where rank 0's CPU went: [user, system] ms per op by thread name.
            "rank0_cpu_ms_per_op_by_thread": replies[0].get("cpu_ms_per_op_by_thread", {})})
        result["errors"] += job.errors(replies)
