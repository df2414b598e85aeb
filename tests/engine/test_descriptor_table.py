"""The process's fd table is grown once, at `import torch_reccl` (and at the
first "reccl" group of a process forked after the import), so that no dial or
accept of a first use waits for the kernel to grow it (in a multi-threaded
process each doubling waits for an RCU grace period: 10-45 ms on our VMs;
transport/descriptor_table.h)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, os, resource, sys, tempfile, time
    import torch, torch.distributed as dist
    soft = int(sys.argv[1])
    if soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def fd_size():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("FDSize:"))

    def grown(before):
        deadline = time.monotonic() + 10
        while fd_size() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        return fd_size()

    before = fd_size()
    import torch_reccl  # noqa: F401 - the import starts the growth
    imported = grown(before)
    if os.fork() == 0:  # a child forked after it gets a table for its open fds only
        child_before = fd_size()
        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group("reccl", store=store, rank=0, world_size=1)
        print(json.dumps({"child_before": child_before, "child_after": grown(child_before)}), flush=True)
        os._exit(0)
    os.wait()
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("reccl", store=store, rank=0, world_size=1)
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.destroy_process_group()
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(json.dumps({"before": before, "imported": imported, "after": fd_size(), "soft": limit,
                      "sum": x.tolist()}))
""")


def run_child(soft: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(soft)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    child, parent = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    return {**child, **parent}


@pytest.mark.timeout(90)
def test_import_and_a_forked_childs_first_group_grow_the_fd_table():
    got = run_child(0)
    target = min(4096, got["soft"])
    assert got["before"] < target, got  # the test could fail: the table was smaller
    assert got["imported"] >= target and got["after"] >= target, got
    assert got["child_before"] < target <= got["child_after"], got
    assert got["sum"] == [1.0] * 4


@pytest.mark.timeout(90)
def test_reserve_stops_at_the_soft_fd_limit():
    got = run_child(512)
    assert got["soft"] == 512
    assert 512 <= got["imported"] < 4096, got  # up to the limit, never beyond it
    assert got["sum"] == [1.0] * 4
