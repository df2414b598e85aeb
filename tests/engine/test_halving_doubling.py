"""all_reduce, reduce_scatter and all_gather by recursive halving and doubling
(RECCL_ALGO=halving) at 2, 3, 4, 5, 7, 8 and 16 ranks, bit for bit against
local references.

One spawned job of 16 ranks runs the three on the groups of the first k ranks,
for every k: every reduce op of float32, int32, float16, bfloat16, int64, uint8
and bool (every dtype for all_gather) at a count below k (blocks of nothing)
and at an odd count of several 4 KiB chunks per step, and float32 and int32
SUM at other odd counts (inputs of test_collectives.py: small integers, exact
in any order, so the ring's results too). Random float32 sums (inexact, so the
order of reduction shows in the bits) of all_reduce and reduce_scatter must
equal, bit for bit, a local sum in the order halving_doubling.h documents,
the same on every rank and when run again. The test also checks that halving
is what ran for each collective: on channel 1 (which only the data phase uses)
each rank sends to its log2 P partners and, where it folds, its neighbour; the
ring would send to its successor only. It runs twice: all ranks on one host
(positions are ranks), and ranks dealt round-robin over three emulated hosts
(RECCL_HOST_ID), where partners are positions in the layout's host-by-host
order.
"""
from __future__ import annotations

import datetime
import hashlib
import os

import pytest

from collective_checks import DTYPES, LIGHT_DTYPES, all_gather_every_type, reduce_scatter_every_type
from conftest import init_rank_groups, reccl_env, report_rank, run_rank_job

WORLD = 16
GROUP_SIZES = (2, 3, 4, 5, 7, 8, 16)
COUNTS = (1, 3, 13, 5001)    # below every k but 2, odd, and several chunks per step
FULL_COUNTS = (3, 5001)      # every dtype and op; the others float32 and int32 SUM
JOB_TIMEOUT_S = 280
HOSTS = 3                    # "round-robin": rank r on emulated host r % 3


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


def halving_sum(values):
    """The sum of `values` (float32 tensors in position order) in the order
    halving_doubling.h documents: the fold pairs first, then the core's
    partners at distance 1, 2, ..., P/2, nearest first (float addition
    commutes, so which partner's partial comes first does not change the bits)."""
    k = len(values)
    pow2 = 1
    while pow2 * 2 <= k:
        pow2 *= 2
    extra = k - pow2
    core = [values[2 * v + 1] + values[2 * v] if v < extra else values[v + extra] for v in range(pow2)]
    for d in _distances(pow2):
        core = [core[v] + core[v ^ d] for v in range(pow2)]
    return core[0]


def random_floats(rank, n, torch, salt=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n + salt))


def float_bits(rank, k, group, dist, torch):
    """Random float32 sums (inexact, so the order of reduction shows in the
    bits): all_reduce's and reduce_scatter's, each as its SHA-256 and as a
    mismatch count against halving_sum() over the layout's positions."""
    out = []
    order = None
    for n in (3, 5001):
        t = random_floats(rank, n, torch)
        inputs = [random_floats(r, n, torch) for r in range(k)]
        dist.all_reduce(t, group=group)
        order = order or _positions(group)
        want = halving_sum([inputs[r] for r in order])
        out += [hashlib.sha256(t.numpy().tobytes()).hexdigest(), int((t != want).sum())]
        blocks = [random_floats(r, k * n, torch, salt=1) for r in range(k)]
        mine = torch.empty(n)
        dist.reduce_scatter_tensor(mine, blocks[rank], group=group)
        want = halving_sum([blocks[r][rank * n:(rank + 1) * n] for r in order])
        out += [hashlib.sha256(mine.numpy().tobytes()).hexdigest(), int((mine != want).sum())]
    return out


def _positions(group):
    from torch_reccl.backend import backend_info

    return backend_info(group)["ring_order"]


def all_reduce_every_type(rank, k, group, dist):
    from collective_checks import check_equal, make_input, ops_for, reference

    for n in COUNTS:
        for dtype in DTYPES if n in FULL_COUNTS else LIGHT_DTYPES:
            for op in ops_for(dtype) if n in FULL_COUNTS else ("SUM",):
                t = make_input(rank, n, dtype, op, salt=k)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
                inputs = [make_input(r, n, dtype, op, salt=k) for r in range(k)]
                check_equal(t, reference(inputs, op, dtype), f"all_reduce {dtype} {op} k={k} n={n}")


# One fresh group per collective and group size, so each group's channel-1
# peers are those of one collective's algorithm.
KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def rank_main(rank, port, out_dir, placement):
    os.environ.update(reccl_env(SMALL_BYTES=0, ALGO="halving", HEARTBEAT_MS=3000,
                                CONNECT_TIMEOUT_MS=20000, NO_PATH_TIMEOUT_MS=30000))
    if placement == "round-robin":  # positions differ from ranks (two-level layout)
        os.environ["RECCL_HOST_ID"] = f"host-{rank % HOSTS}"

    def body(result):
        from torch_reccl.backend import backend_info

        torch, dist, floats = init_rank_groups(rank, port, WORLD, GROUP_SIZES)
        groups = {kind: {k: dist.new_group(list(range(k)), timeout=datetime.timedelta(seconds=60))
                         for k in GROUP_SIZES} for kind in KINDS}
        for k in GROUP_SIZES:
            if rank < k:
                all_reduce_every_type(rank, k, groups["all_reduce"][k], dist)
                reduce_scatter_every_type(rank, k, groups["reduce_scatter"][k], dist, torch, COUNTS, FULL_COUNTS)
                all_gather_every_type(rank, k, groups["all_gather"][k], dist, torch, COUNTS, FULL_COUNTS)
                result[f"floats_k{k}"] = float_bits(rank, k, floats[k], dist, torch)
                result[f"floats_again_k{k}"] = float_bits(rank, k, floats[k], dist, torch)
                for kind in KINDS:
                    result[f"peers_{kind}_k{k}"] = sorted(backend_info(groups[kind][k])["send_peers"][1])
            dist.barrier()
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("placement", ["one-host", "round-robin"])
def test_halving_at_every_group_size(tmp_path, placement):
    results = run_rank_job(tmp_path, rank_main, WORLD, (placement,), JOB_TIMEOUT_S)
    for k in GROUP_SIZES:
        bits = [results[r][f"floats_k{k}"] for r in range(k)]
        # [all_reduce hash, mismatches, reduce_scatter hash, mismatches] per count
        assert all(b[1::2] == [0, 0, 0, 0] for b in bits), \
            f"k={k}: float sums differ from the documented order (elements off per rank): {bits}"
        assert len({(b[0], b[4]) for b in bits}) == 1, f"k={k}: ranks ended all_reduce with different bits"
        again = [results[r][f"floats_again_k{k}"] for r in range(k)]
        assert again == bits, f"k={k}: a second run gave other bits"
        order = ring_order(k, placement)
        for p in range(k):
            want = sorted(order[q] for q in expected_peers(p, k))
            for kind in KINDS:
                got = results[order[p]][f"peers_{kind}_k{k}"]
                assert got == want, f"k={k} {kind}: rank {order[p]} (position {p}) sent to {got}, not {want}"


def mismatch_main(rank, port, out_dir):
    # Rank 0 forces halving, rank 1 the ring: a large all_reduce must fail on
    # both with the same message naming the settings, before any data moves.
    os.environ.update(reccl_env(SMALL_BYTES=0,
                                ALGO="halving" if rank == 0 else "ring"))

    def body(result):
        torch, dist, _ = init_rank_groups(rank, port, 2, timeout_s=30, store_timeout_s=60)
        try:
            dist.all_reduce(torch.ones(100000))
            result["error_message"] = None
        except Exception as error:  # noqa: BLE001 - the mismatch is the point
            result["error_message"] = str(error)
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


@pytest.mark.timeout(90)
def test_ranks_forcing_different_algorithms_fail_alike(tmp_path):
    results = run_rank_job(tmp_path, mismatch_main, 2, (), 60)
    messages = [r["error_message"] for r in results]
    assert all(m and "RECCL_ALGO must be the same on every rank" in m for m in messages), messages
