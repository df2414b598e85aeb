"""Shares sized by usable bandwidth (engine/shares.h, engine/proportional.h).

The rules without a network: the share weights (the water-filling optimum of a
direct reduce-scatter + all-gather), the share rule's hysteresis, and what the
agreement carries for it. Then one session of 4 real ranks on 4 loopback NICs
with RECCL_SHARES=proportional: rank 0's NIC 0 goes down, the ranks agree on
unequal shares, and every all_reduce is bit-identical to the fault-free run of
the same inputs, with values chosen so that another summation order changes
the bits; after the heal, under DCR's plan with equal shares, still; and once
the ring runs again, the direct transfers' connections are closed.
"""
from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest

from torch_reccl._native import native

from conftest import report_rank, run_rank_job

_C = native()
FULL = 4096  # kFullCapacity
ALL_REDUCE = 1
SESSION_TIMEOUT_S = 120


# --------------------------------------------------------------------------- share weights


def shares(size, reduced):
    weights = _C._share_weights(size, reduced)
    return [w / sum(weights) for w in weights] if weights else None


def slowest_time(size, capacities, share):
    """The model the weights minimise: rank i sends S + (N-2) s_i at its capacity."""
    return max((1 + (size - 2) * s) / c for s, c in zip(share, capacities))


def test_nothing_reduced_is_equal_shares():
    assert shares(4, []) is None
    assert shares(8, []) is None


def test_one_host_with_three_of_four_nics_reduces_a_third_as_much():
    got = shares(4, [(0, 3 * FULL // 4)])
    assert got == pytest.approx([0.1, 0.3, 0.3, 0.3])
    # 0.9375 of fault-free in the model, against 0.75 with equal shares
    free = slowest_time(4, [1] * 4, [0.25] * 4)
    assert free / slowest_time(4, [0.75, 1, 1, 1], got) == pytest.approx(0.9375)
    assert free / slowest_time(4, [0.75, 1, 1, 1], [0.25] * 4) == pytest.approx(0.75)


def test_a_host_at_half_reduces_nothing():
    assert shares(4, [(2, FULL // 2)]) == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])


@pytest.mark.parametrize("size", [3, 5, 8, 16])
def test_the_weights_are_the_models_optimum(size):
    rng = np.random.default_rng(size)
    for _ in range(20):
        reduced = [(int(r), int(rng.integers(1, FULL))) for r in rng.choice(size, 2, replace=False)]
        capacities = [1.0] * size
        for r, c in reduced:
            capacities[r] = c / FULL
        got = shares(size, reduced)
        best = slowest_time(size, capacities, got)
        for _ in range(50):  # no nearby division does better
            trial = np.clip(np.array(got) + rng.normal(0, 0.01, size), 0, None)
            assert slowest_time(size, capacities, trial / trial.sum()) >= best * (1 - 1e-9)


def test_two_ranks_or_equal_capacities_keep_equal_shares():
    assert shares(2, [(0, FULL // 4)]) is None  # each rank sends S whatever the shares
    assert shares(4, [(r, 3 * FULL // 4) for r in range(4)]) is None  # a rail down everywhere


# --------------------------------------------------------------------------- the share rule


def run_rule(agreed, offset=0, hold=4):
    return _C._share_rule_run(agreed, offset, hold)


def test_a_fall_switches_at_once_and_a_rise_only_after_the_hold():
    down, healed = [(0, 3072)], []
    plans = run_rule([healed, down, down, healed, healed, healed, healed, healed, healed])
    assert [p[0] for p in plans] == [0, 1, 1, 1, 1, 1, 1, 2, 2]  # healed from op 3, switched at 3 + 4
    assert plans[1][1] == [(0, 3072)] and plans[7][1] == []


def test_a_flapping_nic_does_not_flap_the_shares():
    down, healed = [(0, 3072)], []
    agreed = [down] + [healed, healed, down] * 10  # never healed for the hold
    plans = run_rule(agreed)
    assert {p[0] for p in plans} == {1}


def test_a_deeper_fall_switches_at_once_and_the_offset_delays_it():
    plans = run_rule([[(1, 3072)], [(1, 2048)]], offset=0)
    assert [p[0] for p in plans] == [1, 2]
    plans = run_rule([[(1, 3072)], [(1, 3072)], [(1, 3072)]], offset=2)
    assert [p[0] for p in plans] == [0, 0, 1]


def test_unknown_capacities_mean_equal_shares_at_once():
    plans = run_rule([[(0, 3072)], None])
    assert plans[1] == (2, [])


# --------------------------------------------------------------------------- the agreement


def fold(n, faults):
    steps = [(0, r) for r in range(1, n)]
    return _C._agreement_decode(_C._agreement_fold(n, [(0, ALL_REDUCE, 8, -1)] * n, faults, steps), n)


def test_ranks_with_nics_down_are_listed_before_ranks_only_on_backup():
    n = 16
    faults = [(0, 1, 0, 4)] * 12 + [(0, 1, 0b1, 4), (0, 0, 0, 4), (0, 1, 0b11, 4), (0, 0, 0, 4)]
    d = fold(n, faults)
    assert d["degraded_ranks"] == 14 and d["reduced_ranks"] == 2
    assert [x[0] for x in d["listed"]] == [12, 14, 0, 1, 2, 3, 4, 5]
    assert d["capacities"] == [(12, 3072), (14, 2048)]


def test_more_reduced_ranks_than_listed_leave_capacities_unknown():
    n = 12
    d = fold(n, [(0, 0, 0b1, 4)] * 10 + [(0, 0, 0, 4)] * 2)
    assert d["reduced_ranks"] == 10 and d["capacities"] is None
    d = fold(3, [(0, 0, 0b1)] * 3)  # NIC count not said
    assert d["capacities"] is None


# --------------------------------------------------------------------------- end to end


NICS = "127.0.0.1,127.0.0.2,127.0.0.3,127.0.0.4"
COUNT = 300_001  # uneven splits everywhere


def inputs(rank, dtype_name, count=COUNT):
    """Values of mixed sign and magnitude: most sums round differently in another order."""
    rng = np.random.default_rng(1000 + rank)
    values = rng.uniform(-1, 1, count) * 10.0 ** rng.uniform(-2, 2, count)
    return values.astype(np.float64 if dtype_name == "float64" else np.float32)


def rank_main(rank, port, out_dir, size):
    os.environ.update({"RECCL_NICS": NICS, "RECCL_ALGO": "ring", "RECCL_CHUNK_BYTES": "65536",
                       "RECCL_SHARES": "proportional",
                       "RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})

    def body(out):
        import torch
        import torch.distributed as dist

        import torch_reccl
        from torch_reccl.backend import _cpu_backend, _pg_native, backend_info as info

        def connections():
            return _pg_native()._reccl_connections(_cpu_backend(None))

        torch.set_num_threads(1)
        dist.init_process_group("reccl", timeout=datetime.timedelta(seconds=60))
        cases = [("float32", "sum"), ("bfloat16", "sum"), ("float64", "avg")]

        def run_all():
            got = {}
            for dtype_name, op in cases:
                t = torch.from_numpy(inputs(rank, dtype_name)).to(getattr(torch, dtype_name))
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG)
                raw = t.view(torch.int16 if dtype_name == "bfloat16" else
                             torch.int64 if dtype_name == "float64" else torch.int32)
                got[f"{dtype_name}-{op}"] = raw.numpy().tobytes().hex()
            return got

        free = run_all()
        out["shares_before"] = info()["shares"]
        dist.barrier()
        out["connections_free"] = connections()  # the ring's and the barrier's
        if rank == 0:
            torch_reccl.inject_fault("lo:127.0.0.1", "down")
        dist.barrier()  # this op's agreement sees rank 0's NIC down: shares switch here
        out["shares_during"] = info()["shares"]
        faulted = run_all()
        out["same_during"] = {k: faulted[k] == free[k] for k in free}
        out["connections_during"] = connections()
        if rank == 0:
            out["float32_sum"] = free["float32-sum"]
            torch_reccl.inject_fault("lo:127.0.0.1", "up")
        for _ in range(20):  # the rise hold: equal again once the picture holds still
            dist.barrier()
        out["shares_after"] = info()["shares"]
        healed = run_all()
        out["same_after"] = {k: healed[k] == free[k] for k in free}
        # DCR's plan returns to every channel once the connections have failed back
        # (seconds) and its hold has passed; from that op on the ring runs again and
        # the direct form's connections are closed at both ends (every rank sees the
        # same agreed plan at the same op, so the loops end together)
        for _ in range(400):
            if not info()["channels_without_data"]:
                break
            time.sleep(0.05)
            dist.barrier()
        out["plan_equal_again"] = not info()["channels_without_data"]
        healed = run_all()
        out["same_on_the_ring_again"] = {k: healed[k] == free[k] for k in free}
        out["connections_healed"] = connections()
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return run_rank_job(tmp_path_factory.mktemp("shares"), rank_main, 4, (4,),
                        job_timeout_s=SESSION_TIMEOUT_S, store_timeout_s=60)


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
def test_a_rank_with_a_nic_down_gets_a_smaller_share(session):
    for r in session:
        assert r["shares_before"] is None
        assert r["shares_during"] == pytest.approx([0.1, 0.3, 0.3, 0.3], abs=1e-6)
        assert r["shares_after"] is None


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
def test_unequal_shares_give_the_fault_free_bits(session):
    for r in session:
        assert all(r["same_during"].values()), r["same_during"]
        assert all(r["same_after"].values()), r["same_after"]


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
def test_the_direct_forms_connections_close_once_the_ring_is_back(session):
    """Direct transfers connect every pair of ranks; once the fault heals and the
    ring runs again, each rank is back to the connections it had fault-free."""
    for r in session:
        assert r["plan_equal_again"], r
        assert all(r["same_on_the_ring_again"].values()), r["same_on_the_ring_again"]
        assert r["connections_during"] > r["connections_free"], r
        assert r["connections_healed"] == r["connections_free"], r


@pytest.mark.timeout(SESSION_TIMEOUT_S + 30)
def test_the_bits_are_the_ring_orders_and_another_order_differs(session):
    """The fault-free result is the ring's order computed here, and the inputs
    are such that summing in rank order instead changes most elements."""
    size = 4
    got = np.frombuffer(bytes.fromhex(session[0]["float32_sum"]), dtype=np.float32)
    x = [inputs(r, "float32") for r in range(size)]
    ring = np.empty(COUNT, dtype=np.float32)
    first = np.empty(COUNT, dtype=np.int64)  # the position each element's chain starts at
    channels = 4  # one per NIC
    for offset, count, final in _C._ring_reduction_order(COUNT, channels, size):
        part = slice(offset, offset + count)
        first[part] = (final + 1) % size
        acc = x[(final + 1) % size][part].copy()
        for step in range(2, size + 1):
            acc = x[(final + step) % size][part] + acc
        ring[part] = acc
    assert np.array_equal(got.view(np.int32), ring.view(np.int32))
    for start in range(size):  # the ring's chain started at another position
        other = x[start].copy()
        for step in range(1, size):
            other = x[(start + step) % size] + other
        elsewhere = first != start
        differs = np.mean(other.view(np.int32)[elsewhere] != ring.view(np.int32)[elsewhere])
        assert differs > 0.3, f"only {differs:.0%} of the sums depend on the order"
