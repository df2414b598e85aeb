"""One rank of ``reccl bench``: times collectives and reports them to the driver.

Started by :mod:`torch_reccl.bench.cli` with torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT)::

    python -m torch_reccl.bench.rank --backend reccl --device cpu --ops all_reduce \\
        --sizes 1048576 2097152 --warmup 2 --iters 5 --dtype float32

Every measurement is reported by rank 0 as a ``result`` message
(:func:`torch_reccl.cli.launch.report`); the time is the slowest rank's mean time
per operation. After timing, one more operation runs on known inputs and every
element of the output is checked (the ``#wrong`` column, as in nccl-tests).
With ``--pause-before`` the ranks report ``paused`` after warming up the
connections and wait for a ``go`` command (the driver injects a fault then).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
GO_TIMEOUT_S = 120.0


def element_size(dtype_name: str) -> int:
    return {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}[dtype_name]


def shape_for(op: str, size_bytes: int, ranks: int, dtype_name: str):
    """(count, bytes, input elements, output elements) for a nominal size.

    As in nccl-tests, the size is the largest buffer: the input of all_reduce
    and reduce_scatter, the output of all_gather; it is rounded down to a
    multiple of ranks x element size.
    """
    unit = element_size(dtype_name) * (ranks if op != "all_reduce" else 1)
    size_bytes = max(unit, size_bytes // unit * unit)
    count = size_bytes // element_size(dtype_name)
    if op == "all_reduce":
        return count, size_bytes, count, count
    if op == "all_gather":
        return count, size_bytes, count // ranks, count
    return count, size_bytes, count, count // ranks


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' busbw = algbw x factor: 2(n-1)/n for all_reduce, (n-1)/n otherwise."""
    if op == "all_reduce":
        return 2.0 * (ranks - 1) / ranks
    return (ranks - 1) / ranks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_reccl.bench.rank")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ops", nargs="+", choices=OPS, required=True)
    parser.add_argument("--sizes", nargs="+", type=int, required=True)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--pause-before", action="store_true",
                        help="after warming up, report 'paused' and wait for a 'go' command")
    args = parser.parse_args(argv)

    from torch_reccl.cli.launch import listen_for_commands, report

    go = threading.Event()

    def on_command(message: dict) -> None:
        if message.get("cmd") != "go":
            return
        # Loopback placement: the driver cannot reach this process's NICs, so it
        # names the faults to inject here before the ranks go on.
        for nic, kind in message.get("inject", []):
            import torch_reccl

            torch_reccl.inject_fault(nic, kind)
        go.set()

    if args.pause_before:
        listen_for_commands(on_command)

    import torch
    import torch.distributed as dist

    import torch_reccl  # noqa: F401 - registers "reccl"; points NCCL at the plugin

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    ranks = int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(args.backend, timeout=timeout)
    dtype = getattr(torch, args.dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # connections exist before timing (and before any fault the driver injects)
    warm = torch.ones(1 << 16, dtype=dtype, device=device)
    dist.all_reduce(warm)
    sync()
    if args.pause_before:
        report("paused")
        if not go.wait(GO_TIMEOUT_S):
            print(f"rank {rank}: no 'go' from the driver within {GO_TIMEOUT_S:.0f} s", file=sys.stderr)
            return 1
        dist.all_reduce(warm)
        sync()

    for op in args.ops:
        for nominal in args.sizes:
            count, size_bytes, n_in, n_out = shape_for(op, nominal, ranks, args.dtype)
            inp = torch.ones(n_in, dtype=dtype, device=device)
            out = inp if op == "all_reduce" else torch.empty(n_out, dtype=dtype, device=device)
            for _ in range(args.warmup):
                inp.fill_(1)
                run_collective(op, out, inp)
            inp.fill_(1)  # all_reduce works in place: keep the values small and finite
            sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                run_collective(op, out, inp)
            sync()
            elapsed = (time.perf_counter() - start) / max(1, args.iters)
            slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds = float(slowest.item())
            wrong = check(op, inp, out, rank, ranks, torch, dist)
            if rank == 0:
                algbw = size_bytes / seconds / 1e9
                report("result", op=op, bytes=size_bytes, count=count, dtype=args.dtype,
                       time_us=seconds * 1e6, algbw=algbw, busbw=algbw * bus_factor(op, ranks),
                       wrong=wrong)
            del inp, out
    dist.barrier()
    sync()
    if rank == 0 and args.backend == "reccl":
        nics = torch_reccl.stats()["nics"]
        report("failovers", count=sum(int(n.get("failovers", 0)) for n in nics.values()))
    dist.destroy_process_group()
    return 0


def run_collective(op: str, out, inp) -> None:
    """One collective of OPS: all_reduce in place on ``inp``, the others into ``out``."""
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, inp)
    else:
        dist.reduce_scatter_tensor(out, inp)


def check(op, inp, out, rank, ranks, torch, dist) -> int:
    """Runs the op once on known inputs; the number of wrong output elements,
    summed over ranks. Values are small integers, exact in every dtype."""
    value = (rank % 3) + 1
    inp.fill_(value)
    run_collective(op, out, inp)
    total = sum((r % 3) + 1 for r in range(ranks))
    if op == "all_reduce":
        wrong = int((inp != total).sum().item())
    elif op == "all_gather":
        expected = torch.cat([torch.full((inp.numel(),), (r % 3) + 1, dtype=inp.dtype, device=inp.device)
                              for r in range(ranks)])
        wrong = int((out != expected).sum().item())
    else:
        wrong = int((out != total).sum().item())
    counter = torch.tensor([wrong], dtype=torch.int64, device=inp.device)
    dist.all_reduce(counter)
    return int(counter.item())


if __name__ == "__main__":
    sys.exit(main())
