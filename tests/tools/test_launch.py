"""torch_reccl.cli.launch.spawn_bounded: the bounded spawn the GPU scripts use."""
from __future__ import annotations

import os
import time

import pytest

from torch_reccl.cli.launch import spawn_bounded


def _write_rank(rank: int, out_dir: str) -> None:
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write("ok")


def _sleep(rank: int, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.timeout(60)
def test_ranks_that_finish_are_joined(tmp_path):
    spawn_bounded(_write_rank, (str(tmp_path),), nprocs=2, timeout_s=30)
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]


@pytest.mark.timeout(60)
def test_ranks_past_the_bound_are_killed():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        spawn_bounded(_sleep, (120.0,), nprocs=2, timeout_s=2)
    assert time.monotonic() - start < 20
