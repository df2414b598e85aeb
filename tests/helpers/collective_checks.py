"""The collectives' reference checks, shared by the engine tests (test_collectives.py,
test_collectives_forced.py, test_halving_doubling.py, test_two_level.py) and run in
their rank processes: deterministic small-integer inputs (every reduction exact in
every dtype and order), local references, a bit-for-bit comparison, and the
bodies that run every collective on the group of ranks 0..k-1.
"""
from __future__ import annotations

import functools

FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
INT_OPS = FLOAT_OPS + ["BAND", "BOR", "BXOR"]
BOOL_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
# every_collective: fewer elements than ranks; several 4 KiB chunks per ring step
SMALL, LARGE = 3, 5000
# Reductions: (dtype, op) pairs; test_collectives.py covers every pair at 2 and 4 ranks.
ALL_REDUCE = [("float32", op) for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")] + \
             [("int32", op) for op in ("SUM", "AVG", "BXOR")] + [("bfloat16", "SUM")]
REDUCE = [("float32", "SUM"), ("int32", "BXOR")]
REDUCE_SCATTER = [("float32", "SUM"), ("int32", "AVG")]
# reduce_scatter and all_gather (which halving runs too): every op of these at
# FULL_COUNTS; float32 and int32 SUM at the other counts.
DTYPES = ("float32", "int32", "float16", "bfloat16", "int64", "uint8", "bool")
LIGHT_DTYPES = ("float32", "int32")


def _torch():
    import torch

    return torch


def dtype_of(name):
    return getattr(_torch(), name)


def ops_for(dtype_name):
    if dtype_name == "bool":
        return BOOL_OPS
    if dtype_name in ("float16", "bfloat16", "float32", "float64"):
        return FLOAT_OPS
    return INT_OPS


def make_input(rank, n, dtype_name, op="SUM", salt=0):
    """Deterministic small-integer values, so every reduction is exact in every dtype."""
    torch = _torch()
    g = torch.Generator().manual_seed(1000 * salt + 17 * rank + n)
    if dtype_name == "bool":
        return torch.randint(0, 2, (n,), generator=g).bool()
    if op == "PRODUCT":
        values = torch.randint(1, 3, (n,), generator=g)
        if dtype_name != "uint8":
            values = values * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    elif dtype_name == "uint8":
        values = torch.randint(0, 4, (n,), generator=g)
    else:
        values = torch.randint(-3, 4, (n,), generator=g)
    return values.to(dtype_of(dtype_name))


def reference(inputs, op, dtype_name):
    torch = _torch()
    size = len(inputs)
    if dtype_name == "bool":
        stacked = torch.stack([t.to(torch.int64) for t in inputs])
        if op in ("SUM", "MAX", "BOR"):
            return stacked.amax(0).bool()
        if op in ("PRODUCT", "MIN", "BAND"):
            return stacked.amin(0).bool()
        return (stacked.sum(0) % 2).bool()
    floating = dtype_name in ("float16", "bfloat16", "float32", "float64")
    wide = torch.stack([t.to(torch.float64 if floating else torch.int64) for t in inputs])
    if op == "SUM":
        out = wide.sum(0)
    elif op == "AVG":
        out = wide.sum(0) / size if floating else torch.div(wide.sum(0), size, rounding_mode="trunc")
    elif op == "PRODUCT":
        out = wide.prod(0)
    elif op == "MIN":
        out = wide.amin(0)
    elif op == "MAX":
        out = wide.amax(0)
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = functools.reduce(fn, list(wide))
    return out.to(dtype_of(dtype_name))


def check_equal(got, expected, what):
    torch = _torch()
    if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(got, expected):
        bad = (got != expected).nonzero()
        first = bad[0].tolist() if len(bad) else None
        raise AssertionError(f"{what}: differs (dtype {got.dtype}/{expected.dtype}, shape "
                             f"{tuple(got.shape)}/{tuple(expected.shape)}, first difference at {first})")


def split_sizes(sender, receiver, scale):
    return (sender * 3 + receiver * 5 + 1) % 4 * scale  # uneven, some zero


def collectives(rank, k, group, dist, torch):
    """Every collective but all_to_all on the group of ranks 0..k-1 (rank is a member)."""
    for n in (SMALL, LARGE):
        where = f"k={k} n={n}"
        for dtype, op in ALL_REDUCE:
            t = make_input(rank, n, dtype, op, salt=k)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
            expected = reference([make_input(r, n, dtype, op, salt=k) for r in range(k)], op, dtype)
            check_equal(t, expected, f"all_reduce {dtype} {op} {where}")
        for root in (0, k - 1):
            for dtype, op in REDUCE:
                t = make_input(rank, n, dtype, op, salt=root)
                before = t.clone()
                dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op), group=group)
                expected = reference([make_input(r, n, dtype, op, salt=root) for r in range(k)], op, dtype)
                check_equal(t, expected if rank == root else before, f"reduce {dtype} {op} root={root} {where}")
            t = make_input(rank, n, "float32", salt=root)
            dist.broadcast(t, src=root, group=group)
            check_equal(t, make_input(root, n, "float32", salt=root), f"broadcast root={root} {where}")
            mine = make_input(rank, n, "int32", salt=root)
            outs = [torch.empty_like(mine) for _ in range(k)] if rank == root else None
            dist.gather(mine, outs, dst=root, group=group)
            for r in range(k if rank == root else 0):
                check_equal(outs[r], make_input(r, n, "int32", salt=root), f"gather from {r} root={root} {where}")
            blocks = [make_input(r, n, "float32", salt=root + 1) for r in range(k)]
            out = torch.empty(n)
            dist.scatter(out, blocks if rank == root else None, src=root, group=group)
            check_equal(out, blocks[rank], f"scatter root={root} {where}")
        every = [make_input(r, n, "float32", salt=k + 1) for r in range(k)]
        outs = [torch.empty(n) for _ in range(k)]
        dist.all_gather(outs, every[rank], group=group)
        for r in range(k):
            check_equal(outs[r], every[r], f"all_gather from {r} {where}")
        for dtype, op in REDUCE_SCATTER:
            inputs = [make_input(r, k * n, dtype, op, salt=k) for r in range(k)]
            out = torch.empty(n, dtype=inputs[0].dtype)
            dist.reduce_scatter_tensor(out, inputs[rank], op=getattr(dist.ReduceOp, op), group=group)
            expected = reference(inputs, op, dtype)[rank * n:(rank + 1) * n]
            check_equal(out, expected, f"reduce_scatter {dtype} {op} {where}")


def reduce_scatter_every_type(rank, k, group, dist, torch, counts, full_counts):
    """reduce_scatter_tensor, and the list form at the last full count, of
    every dtype and op of DTYPES at `full_counts` (float32 and int32 SUM at the
    other `counts`) on the group of ranks 0..k-1."""
    for n in counts:
        for dtype in DTYPES if n in full_counts else LIGHT_DTYPES:
            for op in ops_for(dtype) if n in full_counts else ("SUM",):
                inputs = [make_input(r, k * n, dtype, op, salt=k) for r in range(k)]
                expected = reference(inputs, op, dtype)[rank * n:(rank + 1) * n]
                out = torch.empty(n, dtype=inputs[0].dtype)
                dist.reduce_scatter_tensor(out, inputs[rank], op=getattr(dist.ReduceOp, op), group=group)
                where = f"{dtype} {op} k={k} n={n}"
                check_equal(out, expected, f"reduce_scatter_tensor {where}")
                if n == full_counts[-1]:
                    out = torch.empty(n, dtype=inputs[0].dtype)
                    dist.reduce_scatter(out, list(inputs[rank].chunk(k)), op=getattr(dist.ReduceOp, op),
                                        group=group)
                    check_equal(out, expected, f"reduce_scatter {where}")


def all_gather_every_type(rank, k, group, dist, torch, counts, full_counts):
    """all_gather_into_tensor and the list form, of every dtype of DTYPES at
    `full_counts` (float32 and int32 at the other `counts`)."""
    for n in counts:
        for dtype in DTYPES if n in full_counts else LIGHT_DTYPES:
            every = [make_input(r, n, dtype, salt=k + 1) for r in range(k)]
            out = torch.empty(k * n, dtype=every[0].dtype)
            dist.all_gather_into_tensor(out, every[rank], group=group)
            check_equal(out, torch.cat(every), f"all_gather_into_tensor {dtype} k={k} n={n}")
            outs = [torch.empty_like(every[0]) for _ in range(k)]
            dist.all_gather(outs, every[rank], group=group)
            for r in range(k):
                check_equal(outs[r], every[r], f"all_gather from {r} {dtype} k={k} n={n}")


def all_to_all(rank, k, group, dist, torch):
    """Uneven all_to_all_single (some pairs send nothing) on the group of ranks 0..k-1."""
    for scale in (1, 700):
        in_splits = [split_sizes(rank, r, scale) for r in range(k)]
        out_splits = [split_sizes(r, rank, scale) for r in range(k)]
        inp = torch.cat([make_input(rank, in_splits[r], "int32", salt=r) for r in range(k)])
        out = torch.empty(sum(out_splits), dtype=torch.int32)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        expected = torch.cat([make_input(r, out_splits[r], "int32", salt=rank) for r in range(k)])
        check_equal(out, expected, f"all_to_all k={k} scale={scale}")
