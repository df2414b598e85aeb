"""Every collective with each algorithm forced in turn, at 2, 3, 4, 5, 7, 8 and
16 ranks, bit for bit against local references.

The engine picks recursive doubling or the channels by size (docs/collectives.md,
"Which algorithm runs"); RECCL_SMALL_BYTES forces the choice for every size:
0 sends everything through the channels (rings, chains and direct transfers over
both NICs), 1 MiB sends everything here through recursive doubling inside the
agreement; RECCL_ALGO=halving with 0 runs all_reduce, reduce_scatter and
all_gather by recursive halving and/or doubling over the channels instead of
the rings. One spawned job of 16 ranks per algorithm runs the collectives on
the groups of the first k ranks, for every k; reduce_scatter and all_gather of
every dtype and op of DTYPES. Inputs and references are those of
test_collectives.py: small integers, so every reduction is exact in any order
and the results must equal the local reference bit for bit.

The test also checks that the forced algorithm is the one that ran: recursive
doubling moves data over channel 0 only, so the second NIC carries no
collective byte, while the channels put data on both. all_to_all always runs
by the channels, so it runs last, after that check.
"""
from __future__ import annotations

import os

import pytest

from conftest import BACKUP, init_rank_groups, reccl_env, report_rank, run_rank_job

WORLD = 16
GROUP_SIZES = (2, 3, 4, 5, 7, 8, 16)
SMALL, LARGE = 3, 5000        # fewer elements than ranks; several 4 KiB chunks per ring step
# Settings per algorithm; 1 MiB > 16 ranks x 5000 x 8 bytes. "halving" changes
# all_reduce, reduce_scatter and all_gather (test_halving_doubling.py).
FORCED = {"channels": {"SMALL_BYTES": 0}, "recursive-doubling": {"SMALL_BYTES": 1 << 20},
          "halving": {"SMALL_BYTES": 0, "ALGO": "halving"}}
JOB_TIMEOUT_S = 280
# Reductions: (dtype, op) pairs; test_collectives.py covers every pair at 2 and 4 ranks.
ALL_REDUCE = [("float32", op) for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")] + \
             [("int32", op) for op in ("SUM", "AVG", "BXOR")] + [("bfloat16", "SUM")]
REDUCE = [("float32", "SUM"), ("int32", "BXOR")]
REDUCE_SCATTER = [("float32", "SUM"), ("int32", "AVG")]
# reduce_scatter and all_gather (which halving runs too): every op of these at
# FULL_COUNTS; float32 and int32 SUM at the other counts.
DTYPES = ("float32", "int32", "float16", "bfloat16", "int64", "uint8", "bool")
LIGHT_DTYPES = ("float32", "int32")


def collectives(rank, k, group, dist, torch):
    """Every collective but all_to_all on the group of ranks 0..k-1 (rank is a member)."""
    from test_collectives import check_equal, make_input, reference

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
    from test_collectives import check_equal, make_input, ops_for, reference

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
    from test_collectives import check_equal, make_input

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
    from test_collectives import check_equal, make_input, split_sizes

    for scale in (1, 700):
        in_splits = [split_sizes(rank, r, scale) for r in range(k)]
        out_splits = [split_sizes(r, rank, scale) for r in range(k)]
        inp = torch.cat([make_input(rank, in_splits[r], "int32", salt=r) for r in range(k)])
        out = torch.empty(sum(out_splits), dtype=torch.int32)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        expected = torch.cat([make_input(r, out_splits[r], "int32", salt=rank) for r in range(k)])
        check_equal(out, expected, f"all_to_all k={k} scale={scale}")


def backup_nic_bytes(torch_reccl):
    return torch_reccl.stats()["nics"][BACKUP]["bytes_sent"]


def rank_main(rank, port, out_dir, algorithm):
    os.environ.update(reccl_env(**FORCED[algorithm], HEARTBEAT_MS=3000,
                                CONNECT_TIMEOUT_MS=20000, NO_PATH_TIMEOUT_MS=30000))

    def body(result):
        import torch_reccl

        torch, dist, groups = init_rank_groups(rank, port, WORLD, GROUP_SIZES)
        dist.barrier()  # builds the shared transport, whose NICs the stats then list
        for k, group in groups.items():
            if rank < k:
                before = backup_nic_bytes(torch_reccl)
                collectives(rank, k, group, dist, torch)
                reduce_scatter_every_type(rank, k, group, dist, torch, (SMALL, LARGE), (LARGE,))
                all_gather_every_type(rank, k, group, dist, torch, (SMALL, LARGE), (LARGE,))
                result[f"backup_nic_bytes_k{k}"] = backup_nic_bytes(torch_reccl) - before
            dist.barrier()
        for k, group in groups.items():
            if rank < k:
                all_to_all(rank, k, group, dist, torch)
            dist.barrier()
        result["failovers"] = sum(nic["failovers"] for nic in torch_reccl.stats()["nics"].values())
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("algorithm", list(FORCED))
def test_every_collective_at_every_group_size(tmp_path, algorithm):
    results = run_rank_job(tmp_path, rank_main, WORLD, (algorithm,), JOB_TIMEOUT_S)
    # A failover would move channel 0 onto the backup NIC and blur the check below.
    assert all(r["failovers"] == 0 for r in results), [r["failovers"] for r in results]
    for k in GROUP_SIZES:
        moved = [results[r][f"backup_nic_bytes_k{k}"] for r in range(k)]
        if algorithm == "recursive-doubling":
            assert all(b == 0 for b in moved), f"k={k}: data went over the channels: {moved}"
        else:
            assert all(b > 0 for b in moved), f"k={k}: a rank sent nothing on channel 1: {moved}"
