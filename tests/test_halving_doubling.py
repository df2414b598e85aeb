"""all_reduce by recursive halving and doubling (RECCL_ALGO=halving) at 2, 3, 4,
5, 7, 8 and 16 ranks, bit for bit against local references.

One spawned job of 16 ranks runs all_reduce on the groups of the first k ranks,
for every k: every reduce op of float32, int32, float16, bfloat16, int64, uint8
and bool at a count below k (blocks of nothing) and at an odd count of several
4 KiB chunks per step, and SUM at other odd counts (inputs of
test_collectives.py: small integers, exact in any order). Random floats (inexact sums, so the order of reduction shows in the
bits) must come out the same on every rank and the same when run again. The
test also checks that halving is what ran: on channel 1 (which only the data
phase uses) each rank sends to its log2 P partners and, where it folds, its
neighbour; the ring would send to its successor only. It runs twice: all ranks
on one host (positions are ranks), and ranks dealt round-robin over three
emulated hosts (RECCL_HOST_ID), where partners are positions in the layout's
host-by-host order.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import traceback

import pytest

from conftest import reccl_env, run_rank_job

WORLD = 16
GROUP_SIZES = (2, 3, 4, 5, 7, 8, 16)
COUNTS = (1, 3, 13, 5001)    # below every k but 2, odd, and several chunks per step
FULL_COUNTS = (3, 5001)      # every dtype and op; the others float32 and int32 SUM
JOB_TIMEOUT_S = 170
HOSTS = 3                    # "round-robin": rank r on emulated host r % 3
DTYPES = ("float32", "int32", "float16", "bfloat16", "int64", "uint8", "bool")


def ring_order(k, placement):
    """Position -> rank in a group of the first k ranks (layout.h: host by host,
    hosts by their lowest rank, each host's ranks in rank order)."""
    if placement == "one-host":
        return list(range(k))
    return sorted(range(k), key=lambda r: (r % HOSTS, r))


def expected_peers(position, k):
    """Positions that `position` sends data-phase bytes to in a group of k."""
    pow2 = 1
    while pow2 * 2 <= k:
        pow2 *= 2
    extra = k - pow2
    if position < 2 * extra and position % 2 == 0:
        return [position + 1]
    v = position // 2 if position < 2 * extra else position - extra
    peers = {(2 * u + 1 if u < extra else u + extra) for u in (v ^ d for d in _distances(pow2))}
    if position < 2 * extra:
        peers.add(position - 1)
    return sorted(peers)


def _distances(pow2):
    d = 1
    while d < pow2:
        yield d
        d *= 2


def float_bits(rank, k, group, dist, torch):
    out = []
    for n in (3, 5001):
        t = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n))
        dist.all_reduce(t, group=group)
        out.append(hashlib.sha256(t.numpy().tobytes()).hexdigest())
    return out


def rank_main(rank, port, out_dir, placement):
    os.environ.update(reccl_env(SMALL_BYTES=0, ALGO="halving", HEARTBEAT_MS=3000,
                                CONNECT_TIMEOUT_MS=20000, NO_PATH_TIMEOUT_MS=30000))
    if placement == "round-robin":  # positions differ from ranks (two-level layout)
        os.environ["RECCL_HOST_ID"] = f"host-{rank % HOSTS}"
    result = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist
        from torch_reccl.backend import Options, backend_info
        from test_collectives import check_equal, make_input, ops_for, reference

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, WORLD, False, timeout=datetime.timedelta(seconds=90))
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("reccl", store=store, rank=rank, world_size=WORLD, timeout=timeout,
                                pg_options=Options(chunk_bytes=4096, window=2))
        groups = {k: dist.new_group(list(range(k)), timeout=timeout) for k in GROUP_SIZES}
        for k, group in groups.items():
            if rank < k:
                for n in COUNTS:
                    for dtype in DTYPES if n in FULL_COUNTS else ("float32", "int32"):
                        for op in ops_for(dtype) if n in FULL_COUNTS else ("SUM",):
                            t = make_input(rank, n, dtype, op, salt=k)
                            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
                            inputs = [make_input(r, n, dtype, op, salt=k) for r in range(k)]
                            check_equal(t, reference(inputs, op, dtype), f"all_reduce {dtype} {op} k={k} n={n}")
                first = float_bits(rank, k, group, dist, torch)
                result[f"floats_k{k}"] = first
                result[f"floats_again_k{k}"] = float_bits(rank, k, group, dist, torch)
                result[f"peers_k{k}"] = sorted(backend_info(group)["send_peers"][1])
            dist.barrier()
        dist.destroy_process_group()
        result["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("placement", ["one-host", "round-robin"])
def test_halving_allreduce_at_every_group_size(tmp_path, placement):
    results = run_rank_job(tmp_path, rank_main, WORLD, (placement,), JOB_TIMEOUT_S)
    for k in GROUP_SIZES:
        bits = {tuple(results[r][f"floats_k{k}"]) for r in range(k)}
        assert len(bits) == 1, f"k={k}: ranks ended with different float bits"
        again = {tuple(results[r][f"floats_again_k{k}"]) for r in range(k)}
        assert again == bits, f"k={k}: a second run gave other bits"
        order = ring_order(k, placement)
        for p in range(k):
            want = sorted(order[q] for q in expected_peers(p, k))
            got = results[order[p]][f"peers_k{k}"]
            assert got == want, f"k={k}: rank {order[p]} (position {p}) sent to {got}, not {want}"


def mismatch_main(rank, port, out_dir):
    # Rank 0 forces halving, rank 1 the ring: a large all_reduce must fail on
    # both with the same message naming the settings, before any data moves.
    os.environ.update(reccl_env(SMALL_BYTES=0,
                                ALGO="halving" if rank == 0 else "ring"))
    result = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist
        import torch_reccl  # noqa: F401 - registers the backend

        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("reccl", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        try:
            dist.all_reduce(torch.ones(100000))
            result["error_message"] = None
        except Exception as error:  # noqa: BLE001 - the mismatch is the point
            result["error_message"] = str(error)
        dist.destroy_process_group()
        result["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.mark.timeout(90)
def test_ranks_forcing_different_algorithms_fail_alike(tmp_path):
    results = run_rank_job(tmp_path, mismatch_main, 2, (), 60)
    messages = [r["error_message"] for r in results]
    assert all(m and "RECCL_ALGO must be the same on every rank" in m for m in messages), messages
