"""The two-level layout: ranks of a group that share a host sit next to each
other in the ring, and small collectives reduce within each host, run recursive
doubling among the host leaders and hand the result back within the host
(docs/collectives.md, "Which algorithm runs").

RECCL_HOST_ID places the ranks of one machine on emulated hosts. One spawned job
of 8 ranks per placement runs, on the groups of the first 4, 6 and 8 ranks (so
every group splits its hosts unevenly or round-robin):
- every collective, small (recursive doubling, two-level) and large (rings,
  chains, direct transfers in the host-grouped order), bit for bit against local
  references (test_collectives_forced.py's inputs: small integers, so every
  reduction is exact in any order and a flat layout gives the same bits);
- random float all_reduces, small and large, whose bits must be equal on every
  rank (the reduction order is fixed and the same everywhere);
- the layout the engine reports (hosts, ring order, agreement partners) against
  the one derived here, and which peers a fresh group's large all_reduce really
  sent to on channel 1 (the rings only): its next rank in the host-grouped ring;
- DCR: rank 5's first NIC goes down; the next collective switches every
  rank to the same plan, without channel 0;
- a member rank, then a host leader, that skips a collective: every other
  rank names it (the leader's members wait for its result; they must name it
  too, not only time out).
A third job with no RECCL_HOST_ID (one host) checks the layout stays flat.
"""
from __future__ import annotations

import datetime
import json
import os

import pytest

from conftest import PRIMARY, init_rank_groups, reccl_env, report_rank, run_rank_job

WORLD = 8
GROUP_SIZES = (4, 6, 8)
# Host of each rank; groups are the first k ranks, so e.g. two-hosts at k=6
# puts ranks 0, 2, 4 on A and 1, 3, 5 on B.
PLACEMENTS = {
    "two-hosts": "ABABABAB",
    "three-hosts": "ABCAABCA",  # k=4: A{0,3} B{1} C{2}; k=6: A{0,3,4} B{1,5} C{2}
    "one-host": None,
}
SMALL_BYTES = 16384          # 3 elements by recursive doubling, 5000 by the channels
JOB_TIMEOUT_S = 75


def expected_layout(hosts):
    """(host index by rank, ring order) for host labels by rank: hosts numbered
    by their lowest rank, the ring host by host, each host's ranks in order."""
    index = {}
    for label in hosts:
        index.setdefault(label, len(index))
    numbers = [index[label] for label in hosts]
    order = [r for h in range(len(index)) for r in range(len(hosts)) if numbers[r] == h]
    return numbers, order


def expected_partners(rank, numbers, order):
    """The agreement partners of `rank` in the two-level schedule: a member
    talks to its leader (the host's lowest rank) only; a leader to its members
    and the other leaders: with 2 hosts each other, with 3 host 0 folds into
    host 1, which exchanges with host 2."""
    hosts = max(numbers) + 1
    leaders = [numbers.index(h) for h in range(hosts)]
    mine = numbers[rank]
    if rank != leaders[mine]:
        return [leaders[mine]]
    members = [r for r in order if numbers[r] == mine and r != rank]
    others = {2: {0: [1], 1: [0]}, 3: {0: [1], 1: [0, 2], 2: [1]}}[hosts][mine]
    return members + [leaders[h] for h in others]


def float_hashes(rank, k, group, dist, torch):
    """Bits of random float all_reduces (inexact sums), small and large."""
    import hashlib

    out = []
    for n in (3, 5000):
        t = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n))
        dist.all_reduce(t, group=group)
        out.append(hashlib.sha256(t.numpy().tobytes()).hexdigest())
    return out


def rank_main(rank, port, out_dir, placement):
    # ALGO=ring: the large all_reduce's peers are the ring order this test checks
    # (auto would take halving at these sizes)
    env = reccl_env(SMALL_BYTES=SMALL_BYTES, ALGO="ring", HEARTBEAT_MS=3000, CONNECT_TIMEOUT_MS=20000,
                    NO_PATH_TIMEOUT_MS=30000)
    hosts = PLACEMENTS[placement]
    if hosts:
        env["RECCL_HOST_ID"] = "host-" + hosts[rank]
    os.environ.update(env)

    def body(result):
        import torch_reccl
        from torch_reccl.backend import backend_info

        from collective_checks import all_to_all, collectives

        torch, dist, groups = init_rank_groups(rank, port, WORLD, GROUP_SIZES, timeout_s=30,
                                               store_timeout_s=60)
        timeout = datetime.timedelta(seconds=30)
        rings = {k: dist.new_group(list(range(k)), timeout=timeout) for k in GROUP_SIZES}
        short = {skipper: dist.new_group(list(range(6)), timeout=datetime.timedelta(seconds=4))
                 for skipper in (3, 1)}
        for k in GROUP_SIZES:
            if rank < k:
                # A fresh group whose only collective is a large all_reduce: on
                # channel 1 it sends to its ring successor and nobody else.
                dist.all_reduce(torch.ones(5000), group=rings[k])
                info = backend_info(rings[k])
                result[f"k{k}"] = {key: info.get(key) for key in
                                   ("hosts", "ring_order", "two_level", "agreement_partners")}
                result[f"k{k}"]["channel1_peers"] = info["send_peers"][1]
                collectives(rank, k, groups[k], dist, torch)
                result[f"k{k}"]["floats"] = float_hashes(rank, k, groups[k], dist, torch)
                all_to_all(rank, k, groups[k], dist, torch)
            dist.barrier()
        if rank == 5:
            torch_reccl.inject_fault(PRIMARY, "down")
        t = torch.full((5000,), float(rank))
        dist.all_reduce(t, group=groups[8])
        assert torch.equal(t, torch.full((5000,), float(sum(range(WORLD))))), "all_reduce with a NIC down"
        info = backend_info(groups[8])
        result["dcr"] = [info["plan"], info["channels_without_data"]]
        if rank == 5:
            torch_reccl.inject_fault(PRIMARY, "up")
        dist.barrier()
        for skipper, group in short.items():
            if rank < 6:
                dist.barrier(group=group)  # the layout is known before the skipped op
                if rank != skipper:
                    try:
                        dist.all_reduce(torch.ones(3), group=group)
                        result[f"skip{skipper}"] = "no error"
                    except RuntimeError as error:
                        result[f"skip{skipper}"] = str(error)
            dist.barrier()
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


def run_job(tmp_path, placement):
    return run_rank_job(tmp_path, rank_main, WORLD, (placement,), JOB_TIMEOUT_S, store_timeout_s=60)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_two_level_layout(tmp_path, placement):
    results = run_job(tmp_path, placement)
    labels = PLACEMENTS[placement] or "A" * WORLD
    for k in GROUP_SIZES:
        numbers, order = expected_layout(labels[:k])
        two_level = len(set(numbers)) > 1 and len(set(numbers)) < k
        where = f"{placement} k={k}"
        for r in range(k):
            got = results[r][f"k{k}"]
            assert got["hosts"] == numbers, f"{where} rank {r}: hosts {got['hosts']}"
            assert got["ring_order"] == order, f"{where} rank {r}: ring {got['ring_order']}"
            assert got["two_level"] == two_level, where
            successor = order[(order.index(r) + 1) % k]
            assert got["channel1_peers"] == [successor], \
                f"{where} rank {r}: the ring sent to {got['channel1_peers']}, expected [{successor}]"
            if two_level:
                assert sorted(got["agreement_partners"]) == sorted(expected_partners(r, numbers, order)), \
                    f"{where} rank {r}: agreement partners {got['agreement_partners']}"
        floats = {tuple(results[r][f"k{k}"]["floats"]) for r in range(k)}
        assert len(floats) == 1, f"{where}: float all_reduce bits differ between ranks"
    plans = {json.dumps(results[r]["dcr"]) for r in range(WORLD)}
    assert len(plans) == 1 and results[0]["dcr"][0] > 0 and results[0]["dcr"][1] == [0], \
        f"plans after rank 5's NIC went down: {plans}"
    # Rank 3 (a member of its host when there are hosts), then rank 1 (a leader)
    # never joins: all name it.
    for skipper in (3, 1):
        for r in set(range(6)) - {skipper}:
            message = results[r][f"skip{skipper}"]
            assert f"rank(s) {skipper} did not join" in message, f"rank {r}: {message}"
