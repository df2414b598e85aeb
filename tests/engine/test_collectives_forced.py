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
tests/helpers/collective_checks.py: small integers, so every reduction is exact in any order
and the results must equal the local reference bit for bit.

The test also checks that the forced algorithm is the one that ran: recursive
doubling moves data over channel 0 only, so the second NIC carries no
collective byte, while the channels put data on both. all_to_all always runs
by the channels, so it runs last, after that check.
"""
from __future__ import annotations

import os

import pytest

from collective_checks import LARGE, SMALL, all_gather_every_type, all_to_all, collectives, reduce_scatter_every_type
from conftest import BACKUP, init_rank_groups, reccl_env, report_rank, run_rank_job

WORLD = 16
GROUP_SIZES = (2, 3, 4, 5, 7, 8, 16)
# Settings per algorithm; 1 MiB > 16 ranks x 5000 x 8 bytes. "halving" changes
# all_reduce, reduce_scatter and all_gather (test_halving_doubling.py).
FORCED = {"channels": {"SMALL_BYTES": 0}, "recursive-doubling": {"SMALL_BYTES": 1 << 20},
          "halving": {"SMALL_BYTES": 0, "ALGO": "halving"}}
JOB_TIMEOUT_S = 280
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
