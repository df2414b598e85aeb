"""GPU check: nccl-tests on the standalone plugin through a real link-down.

bench/nccl_tests_fault.py runs an nccl-tests binary on two MPI ranks (sharing one
GPU with their own NCCL_HOSTID where there is only one), `NCCL_NET_PLUGIN` set to
libnccl-net-reccl.so and each rank's two NICs the ends of two veth pairs; rank 0's
NIC 0 goes down 3 s into the run and up at 8 s. Passes when the binary exits 0,
its own data check (`-c 20`: every element of 20 iterations per size, in place and
out of place) reports 0 wrong values, sizes finished after the fault, and the
plugin logged failovers and failbacks.

Skipped, with the reason, without a CUDA GPU, root, pyroute2, mpirun, or
NCCL_TESTS_DIR (an nccl-tests build folder holding all_reduce_perf and
all_gather_perf, e.g. `make MPI=1` in an nccl-tests checkout; not part of this
repository).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import needs_gpus

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD_DIR = os.environ.get("NCCL_TESTS_DIR", "")
BINARIES = ("all_reduce_perf", "all_gather_perf")


def problem():
    if os.geteuid() != 0:
        return "needs root (veth pairs)"
    if importlib.util.find_spec("pyroute2") is None:
        return "needs pyroute2 (veth pairs)"
    if shutil.which("mpirun") is None:
        return "needs mpirun (nccl-tests built with MPI=1 runs its ranks under MPI)"
    if not BUILD_DIR:
        return "needs an nccl-tests build: set NCCL_TESTS_DIR to the folder with all_reduce_perf"
    missing = [b for b in BINARIES if not os.access(os.path.join(BUILD_DIR, b), os.X_OK)]
    if missing:
        return f"NCCL_TESTS_DIR={BUILD_DIR} lacks {', '.join(missing)}"
    return None


pytestmark = needs_gpus(1) + [pytest.mark.skipif(problem() is not None, reason=problem() or "")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("binary", BINARIES)
def test_nccl_tests_data_check_passes_through_a_link_down(binary, tmp_path):
    record = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "nccl_tests_fault.py"),
                           "--binary", os.path.join(BUILD_DIR, binary), "--down-s", "3", "--up-s", "8",
                           "--timeout", "180", "--json", str(record)],
                          capture_output=True, text=True, timeout=220, cwd=REPO)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    result = json.loads(record.read_text())
    assert result["verdict"] == "ok", tail
    assert result["out_of_bounds"] and all(n == 0 for n in result["out_of_bounds"]), tail
    assert result["failovers"] > 0 and result["failbacks"] > 0, tail
    assert [f["state"] for f in result["faults"]] == ["down", "up"], tail
